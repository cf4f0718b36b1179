"""The kernel hook script (templates/kernel-postinst-nvidia.sh.j2) run for real with the paths
moved into a temp dir: whatever stops the build, it exits 0 (pve-kernel's postinst runs the hooks
with run-parts --exit-on-error), keeps the reason and the login notice."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from operations import kernel_hook
from plan.render import render_template
from spec.models import HostSpec

RELEASE = "6.14.11-1-pve"


def hook(tmp: Path, archive: Path, sha: str, codename: str = "trixie", open_tree: bool = False, **extra) -> str:
    """The hook with its paths under `tmp`; the user space's /etc/os-release says `codename`;
    `open_tree`: NVIDIA's open tree, whose src/ needs a G++ beside the GCC."""
    (tmp / "os-release").write_text(f'VERSION_ID="{13 if codename == "trixie" else 12}"\nVERSION_CODENAME={codename}\n')
    spec = HostSpec(nvidia={"version": "580.95.05", "open": open_tree,
                            "modules_source": {"url": f"file://{archive}", "sha256": sha}})
    context = kernel_hook.hook_context(spec, 2, False)
    context.update(archive=str(archive), state_dir=str(tmp / "state"), pin_file=str(tmp / "pin"),
                   motd_dir=str(tmp / "motd.d"), motd_file=str(tmp / "motd.d/pvegpu-kernel"),
                   modules_dir=str(tmp / "modules"), build_root=str(tmp / "build"),
                   build_parent=str(tmp / "build/580.95.05"), boot_dir=str(tmp / "boot"),
                   grub_cfg=str(tmp / "grub.cfg"), os_release=str(tmp / "os-release"),
                   auto_removal=str(tmp / "bin/proxmox-auto-removal"), trial_pending=str(tmp / "trial-pending"),
                   esp_list=str(tmp / "proxmox-boot-uuids"), **extra)
    return render_template("kernel-postinst-nvidia.sh.j2", **context)


BOOKWORM_GCC12 = "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
BOOKWORM_GCC = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0"  # /usr/bin/gcc -> gcc-12
TRIXIE_GCC14 = "gcc-14 (Debian 14.2.0-19) 14.2.0"
TRIXIE_GXX14 = "g++-14 (Debian 14.2.0-19) 14.2.0"


def stubs_on_path(tmp: Path, stubs: dict[str, str]) -> None:
    """Shell stand-ins on the hook's PATH (tmp/bin): {program: its script's body}."""
    for name, body in stubs.items():
        (tmp / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp / "bin" / name).chmod(0o755)


def compilers(tmp: Path, *banners: str) -> None:
    """Compilers on the hook's PATH, each printing its `--version` line (`gcc-12 (Debian …) 12.2.0`
    is the program gcc-12) and, as `-v`, GCC's last line; any other use logs its arguments."""
    (tmp / "bin").mkdir(exist_ok=True)
    for banner in banners:
        name = banner.split(" ", 1)[0]
        version = banner.rsplit(" ", 1)[1]
        (tmp / "bin" / name).write_text(
            f'#!/bin/sh\ncase "$1" in --version) echo {banner!r};; -v) echo "gcc version {version} (Debian)";; '
            f'*) echo "$0 $*" >> {tmp}/compiled;; esac\n')
        (tmp / "bin" / name).chmod(0o755)


def kernel_built_with(tmp: Path, cc_text: str, *banners: str) -> None:
    """The kernel's build dir, its .config naming the compiler it was built with (`cc_text`), and
    the host's compilers on the hook's PATH (`banners`; bookworm's gcc-12 unless given)."""
    build = tmp / "modules" / RELEASE / "build"
    build.mkdir(parents=True, exist_ok=True)
    (build / "Makefile").write_text("")
    (build / ".config").write_text(f'CONFIG_CC_VERSION_TEXT="{cc_text}"\n')
    compilers(tmp, *(banners or (BOOKWORM_GCC12, BOOKWORM_GCC)))


def run(tmp: Path, script: str) -> subprocess.CompletedProcess:
    path = tmp / "pvegpu-nvidia"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{tmp / 'bin'}:/usr/bin:/bin"}  # no proxmox-boot-tool here
    return subprocess.run(["sh", str(path), RELEASE, f"/boot/vmlinuz-{RELEASE}"], capture_output=True, text=True,
                          env=env, timeout=60)


def test_a_missing_archive_is_kept_as_the_reason_and_the_hook_exits_0(tmp_path):
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest()))
    assert done.returncode == 0, done.stderr
    record = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()
    assert record[1] == (f"nvidia 580.95.05 could not be built for kernel {RELEASE}: its source archive "
                         f"{tmp_path}/none.tar.gz is not on this host (the converge fetches it)")
    assert "no proxmox-boot-tool" in record[2] or record[2].startswith("no installed kernel of trixie has nvidia")
    assert RELEASE in (tmp_path / "motd.d/pvegpu-kernel").read_text()


def test_a_kernel_of_a_gcc_this_host_lacks_is_deferred_before_any_build(tmp_path):
    """Issue 40: the hook picks the kernel's own GCC; a gcc-14 kernel on a host with gcc-12 alone
    (gcc-14 not installed yet) builds nothing: the reason says what to install, and the kernel is
    kept for apt's pass at the end of the dpkg run (its .no-compiler record)."""
    archive = tmp_path / "tree.tar.gz"
    archive.write_bytes(b"tree")
    kernel_built_with(tmp_path, TRIXIE_GCC14)
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(b"tree").hexdigest()))
    assert done.returncode == 0, done.stderr
    reason = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()[1]
    assert reason.endswith(f"it was built with '{TRIXIE_GCC14}' and no installed GCC 14.2.0 matches it (gcc: "
                           f"'{BOOKWORM_GCC}'; modules of another compiler left a host unbootable): install gcc-14"), reason
    assert (tmp_path / f"state/{RELEASE}.no-compiler").exists()
    assert not (tmp_path / "build").exists(), "nothing was built"


@pytest.mark.skipif(os.geteuid() != 0, reason="the state dir must be root's: run as root")
def test_a_state_dir_that_is_not_roots_alone_stops_the_hook_before_it_writes_or_builds(tmp_path):
    """Issue 39: the hook runs as root under apt; a state dir another user can write (its log was
    opened with `: >` and appended with `tee -a`, its records quoted into the motd) is refused: the
    hook says so and exits 0 (apt goes on), writing and building nothing."""
    archive = tmp_path / "tree.tar.gz"
    archive.write_bytes(b"tree")
    (tmp_path / "state").mkdir(mode=0o755)
    os.chown(tmp_path / "state", 65534, 65534)
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(b"tree").hexdigest()))
    assert done.returncode == 0, done.stderr
    assert f"refusing {tmp_path}/state as a root directory: {tmp_path}/state is owned by uid 65534, not root" in done.stderr
    assert "nvidia 580.95.05 was not built for kernel" in done.stderr
    assert list((tmp_path / "state").iterdir()) == []
    assert not (tmp_path / "build").exists() and not (tmp_path / "motd.d").exists()


def test_a_changed_archive_is_refused(tmp_path):
    archive = tmp_path / "tree.tar.gz"
    archive.write_bytes(b"tree, changed")
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(b"tree").hexdigest()))
    assert done.returncode == 0
    assert "does not have sha256" in (tmp_path / f"state/{RELEASE}.failed").read_text()


GOOD = "6.14.8-2-pve"
# what grub-mkconfig writes with GRUB_DEFAULT=saved (00_header.in) and 10_linux's submenu line
GRUB_CFG = """set default="${saved_entry}"
submenu 'Advanced options for Proxmox VE GNU/Linux' $menuentry_id_option 'gnulinux-advanced-4f1e' {
"""


def grub_host(tmp: Path, releases: list[str]) -> None:
    """A GRUB host whose default is saved: stub uname, modinfo (nvidia 580.95.05 for `releases`)
    and grub-editenv (logs the saved_entry it sets, and any other change), and kernels in a boot dir."""
    (tmp / "bin").mkdir()
    (tmp / "boot").mkdir()
    for rel in (GOOD, RELEASE):
        (tmp / f"boot/vmlinuz-{rel}").write_text("")
    (tmp / "grub.cfg").write_text(GRUB_CFG)
    stubs = {"uname": f"echo {GOOD}",
             "modinfo": 'case " $* " in ' + "".join(f'*" {r} "*) echo 580.95.05 ;; ' for r in releases) + "esac",
             "grub-editenv": (f'case "$2 $3" in "set saved_entry="*) echo "${{3#saved_entry=}}" >> {tmp}/saved_entry ;; '
                              f'"unset prev_saved_entry") ;; *) echo "$*" >> {tmp}/grubenv-other ;; esac')}
    stubs_on_path(tmp, stubs)


def test_on_grub_with_a_saved_default_a_failed_kernel_leaves_saved_entry_on_the_good_one(tmp_path):
    """GRUB boots saved_entry, not the pin file (the boot stage's GRUB_DEFAULT=saved): the hook
    sets it to the last kernel with modules, by the entry id proxmox-kernel-helper uses."""
    grub_host(tmp_path, [GOOD])
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest()))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "saved_entry").read_text() == (
        f"gnulinux-advanced-4f1e>gnulinux-{GOOD}-advanced-4f1e\n")
    assert not (tmp_path / "grubenv-other").exists()  # next_entry (a trial's one-shot) is left alone
    assert (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()[2].startswith(
        f"{GOOD} stays the boot default (GRUB's saved entry, set by pvegpu")


def test_on_grub_esps_the_hook_pins_instead_of_writing_the_roots_grubenv(tmp_path):
    """Issue 38 2.4: with proxmox-boot-tool ESPs (here in its grub mode) GRUB reads the ESP's
    grubenv, never /boot/grub/grubenv, even where the root's grub.cfg says saved: the hook keeps the
    default with the pin (refresh makes it the ESP grub.cfg's GRUB_DEFAULT), not grub-set-default."""
    grub_host(tmp_path, [GOOD])
    (tmp_path / "proxmox-boot-uuids").write_text("2A4C-77E1\n")
    (tmp_path / "bin/proxmox-boot-tool").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/pbt\n')
    (tmp_path / "bin/proxmox-boot-tool").chmod(0o755)
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest()))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "saved_entry").exists()  # the root's grubenv untouched
    assert (tmp_path / "pbt").read_text().splitlines() == [f"kernel pin {GOOD}"]
    assert f"{GOOD} stays the boot default (pinned by pvegpu" in (tmp_path / f"state/{RELEASE}.failed").read_text()


def test_on_grub_a_later_kernel_with_modules_moves_the_saved_entry_on(tmp_path):
    grub_host(tmp_path, [GOOD, RELEASE])
    (tmp_path / "state").mkdir()
    (tmp_path / "state/grub-default").write_text(f"{GOOD}\n")  # set by the hook for a failure before
    (tmp_path / "modules" / RELEASE / "updates/pvegpu-nvidia").mkdir(parents=True)  # its modules are installed
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest()))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "saved_entry").read_text() == (
        f"gnulinux-advanced-4f1e>gnulinux-{RELEASE}-advanced-4f1e\n")
    assert (tmp_path / "state/grub-default").read_text() == f"{RELEASE}\n"


LOGS = Path(__file__).resolve().parents[2] / "fixtures/nvidia-build-log"


def replaying_tree(tmp: Path, log: str) -> Path:
    """An archive in the open tree's layout whose kernel-open make prints a real failed build's
    log (tests/fixtures/nvidia-build-log) and fails as that make did."""
    import tarfile
    top = tmp / "tree/open-gpu-kernel-modules-580.95.05"
    (top / "kernel-open").mkdir(parents=True)
    (top / "version.mk").write_text("NVIDIA_VERSION = 580.95.05\n")
    (top / "kernel-open/Kbuild").write_text("")
    body = "".join((LOGS / log).read_text().splitlines(keepends=True)[2:])
    (top / "kernel-open/recorded.log").write_text(body)
    (top / "kernel-open/Makefile").write_text("modules:\n\t@cat recorded.log; exit 2\n")
    archive = tmp / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return archive


def test_a_compile_error_is_kept_quoted_as_the_reason(tmp_path):
    """The hook's reason (the .failed record, the login notice, --dry and the host check read it)
    quotes the first compile error of the real 595.45.04 log against a kernel without
    <linux/of_gpio.h>, cut at kernel-open/ by the extractor the kernel stage's gate uses."""
    archive = replaying_tree(tmp_path, "595.45.04-kernel-without-of_gpio.txt")
    kernel_built_with(tmp_path, "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0")
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(archive.read_bytes()).hexdigest()))
    assert done.returncode == 0, done.stderr
    reason = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()[1]
    assert reason == (f"nvidia 580.95.05 could not be built for kernel {RELEASE}: the build failed (exit 1): "
                      "kernel-open/common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file or directory")
    assert reason.split(": ", 1)[1] in (tmp_path / "motd.d/pvegpu-kernel").read_text()


def test_headers_installed_after_the_kernel_rerun_the_hook_through_the_apt_post_invoke_pass(tmp_path):
    """Issue 38 2.7: the kernel's postinst ran the hook before its headers were there (Proxmox's
    headers are a package of their own whose postinst runs no hook): the hook keeps that it waits
    for them; its --headers pass (apt's DPkg::Post-Invoke) does nothing while they are missing and
    runs the hook for that kernel once they are (here it goes on to the toolchain check)."""
    archive = tmp_path / "tree.tar.gz"
    archive.write_bytes(b"tree")
    (tmp_path / "boot").mkdir()
    (tmp_path / f"boot/vmlinuz-{RELEASE}").write_text("")
    script = hook(tmp_path, archive, hashlib.sha256(b"tree").hexdigest())
    done = run(tmp_path, script)
    assert done.returncode == 0, done.stderr
    assert "no headers at" in (tmp_path / f"state/{RELEASE}.failed").read_text()
    assert (tmp_path / f"state/{RELEASE}.no-headers").exists()
    path = tmp_path / "pvegpu-nvidia"
    path.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    again = subprocess.run([str(path), "--headers"], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0 and again.stderr == "", again.stderr  # still no headers: nothing runs
    assert (tmp_path / f"state/{RELEASE}.no-headers").exists()
    kernel_built_with(tmp_path, "gcc-14 (Debian 14.2.0-19) 14.2.0")  # the headers arrive
    again = subprocess.run([str(path), "--headers"], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0, again.stderr
    reason = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()[1]
    assert "it was built with 'gcc-14 (Debian 14.2.0-19) 14.2.0'" in reason  # the hook ran for it, past the headers
    assert not (tmp_path / f"state/{RELEASE}.no-headers").exists()
    third = subprocess.run([str(path), "--headers"], capture_output=True, text=True, env=env, timeout=60)
    assert third.stderr == "" and "gcc-14" in (tmp_path / f"state/{RELEASE}.failed").read_text()  # not retried


def test_the_apt_conf_runs_the_hook_s_headers_pass():
    conf = render_template("kernel-headers-apt.conf.j2", path=kernel_hook.HEADERS_CONF, hook=kernel_hook.HOOK)
    assert ('DPkg::Post-Invoke { "if [ -x /etc/kernel/postinst.d/00pvegpu-nvidia ]; then '
            '/etc/kernel/postinst.d/00pvegpu-nvidia --headers || true; fi"; };') in conf


# /etc/kernel/postinst.d of a Proxmox VE host (the twin roots, from the real packages): dkms,
# initramfs-tools, proxmox-kernel-helper's proxmox-auto-removal and zz-proxmox-boot, systemd-boot's
# zz-systemd-boot, grub's zz-update-grub
POSTINST_D = ["dkms", "initramfs-tools", "proxmox-auto-removal", "zz-proxmox-boot", "zz-systemd-boot", "zz-update-grub"]


@pytest.mark.skipif(shutil.which("run-parts") is None, reason="debianutils' run-parts is not installed")
@pytest.mark.parametrize("locale", ["C", "C.UTF-8", "en_US.UTF-8", "de_DE.UTF-8"])
def test_run_parts_runs_the_hook_before_initramfs_tools(tmp_path, locale):
    """Issue 38 §3 (bench/power_cut.py full-upgrade-fails): initramfs-tools' hook runs update-initramfs,
    whose post-update proxmox-boot-sync copies the new kernel onto the ESPs; the hook must have
    installed its modules or pinned the last good kernel before that. run-parts as pve-kernel's
    postinst calls it (debian/proxmox-kernel.postinst.in: no --lsbsysinit, so the name must be
    [A-Za-z0-9_-]), in whatever locale apt was started: ours first (before: after initramfs-tools)."""
    d = tmp_path / "postinst.d"
    d.mkdir()
    for name in [*POSTINST_D, Path(kernel_hook.HOOK).name]:
        (d / name).write_text("#!/bin/sh\n")
        (d / name).chmod(0o755)
    done = subprocess.run(["run-parts", "--test", f"--arg={RELEASE}", f"--arg=/boot/vmlinuz-{RELEASE}", str(d)],
                          capture_output=True, text=True, env={**os.environ, "LC_ALL": locale}, check=True)
    order = [Path(line).name for line in done.stdout.split()]
    assert order[0] == Path(kernel_hook.HOOK).name, order
    assert order[1:] == POSTINST_D, order
    assert Path(kernel_hook.HOOK).parent == Path("/etc/kernel/postinst.d")


BOOKWORM_GOOD = "6.8.12-11-pve"


def upgrade_host(tmp: Path, codename: str) -> None:
    """Mid 8 -> 9 upgrade: 8's kernel runs and has nvidia 580.95.05, 9's ($RELEASE) is being
    installed; proxmox-boot-tool logs what it is asked."""
    (tmp / "bin").mkdir()
    (tmp / "boot").mkdir()
    for rel in (BOOKWORM_GOOD, RELEASE):
        (tmp / f"boot/vmlinuz-{rel}").write_text("")
    stubs = {"uname": f"echo {BOOKWORM_GOOD}",
             "modinfo": f'case " $* " in *" {BOOKWORM_GOOD} "*) echo 580.95.05 ;; esac',
             "proxmox-boot-tool": f'echo "$*" >> {tmp}/pbt; [ "$2" ] && echo "$3" > {tmp}/pin',
             # proxmox-kernel-helper's hook: apt's NeverAutoRemove list from the pin file as it is now
             "proxmox-auto-removal": f'echo "$1 pin=$(cat {tmp}/pin 2>/dev/null)" >> {tmp}/auto-removal'}
    stubs_on_path(tmp, stubs)


@pytest.mark.parametrize("codename", ["trixie", "bookworm"])
def test_the_hook_never_pins_a_kernel_of_another_release_than_the_user_space(tmp_path, codename):
    """Issue 40: 9's kernel fails to build during the dist-upgrade; on main the hook pinned the
    running 8 kernel, so the host rebooted "into 9" on 8's kernel. Whether /etc/os-release says
    trixie (9's user space) or still bookworm (base-files not yet upgraded, $R is the coming
    release's), nothing is pinned: the failure is recorded, deferred to the converge."""
    upgrade_host(tmp_path, codename)
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest(), codename=codename))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "pbt").exists() and not (tmp_path / "pin").exists(), done.stderr
    record = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()
    assert "its source archive" in record[1]
    if codename == "trixie":
        assert record[2] == ("no installed kernel of trixie has nvidia 580.95.05 modules to keep as the boot default; "
                             "deferred to the converge")
    else:
        assert record[2] == (f"{RELEASE} is a trixie kernel and the user space is still bookworm (an upgrade under "
                             "way): pvegpu pins no kernel; deferred to the converge after the upgrade")


def test_on_8_the_hook_still_pins_the_last_good_8_kernel(tmp_path):
    """The same failure on a bookworm host for a bookworm kernel: 8's good kernel is pinned, as before."""
    upgrade_host(tmp_path, "bookworm")
    bad = "6.8.12-12-pve"
    (tmp_path / f"boot/vmlinuz-{bad}").write_text("")
    script = hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest(), codename="bookworm")
    path = tmp_path / "pvegpu-nvidia"
    path.write_text(script)
    done = subprocess.run(["sh", str(path), bad, f"/boot/vmlinuz-{bad}"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pbt").read_text() == f"kernel pin {BOOKWORM_GOOD}\n"
    assert (tmp_path / f"state/{bad}.failed").read_text().splitlines()[2].startswith(
        f"{BOOKWORM_GOOD} stays the boot default (pinned by pvegpu")
    # issue 38 2.9: run-parts ran proxmox-auto-removal before this hook, with no pin; it runs again
    # after the pin, so apt's NeverAutoRemove list keeps the kernel that is the default now
    assert (tmp_path / "auto-removal").read_text() == f"{bad} pin={BOOKWORM_GOOD}\n"


def test_the_hooks_release_of_a_kernel_is_plan_releases_rule():
    """kernel_rel in the hook (sh) answers as plan.releases.kernel_pve_major for every kind of name."""
    from plan.releases import PVE_CODENAME, kernel_pve_major

    text = render_template("kernel-postinst-nvidia.sh.j2", **{**kernel_hook.hook_context(
        HostSpec(nvidia={"version": "580.95.05", "modules_source": {"url": "file:///x.tar.gz", "sha256": hashlib.sha256(b"x").hexdigest()}}),
        2, False)})
    func = text[text.index("kernel_rel() {"):text.index("of_host() {")]
    names = ["6.8.12-11-pve", "6.14.0-1-pve", "6.14.0-2-pvegpu-pve", "6.14.4-1-pve", "6.14.5-1-bpo12-pve",
             "6.14.11-9-bpo12-pvegpu-pve", "6.14.5-1-pve", "6.14.8-2-pve", "6.17.13-21-pvegpu-pve",
             "7.0.14-14-pve", "6.12.118+deb13-amd64", "6.1.0-57-amd64"]
    out = subprocess.run(["/bin/sh", "-c", func + 'for n in "$@"; do echo "$n=$(kernel_rel "$n")"; done', "sh", *names],
                         capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert out == [f"{n}={PVE_CODENAME.get(kernel_pve_major(n) or 0, '')}" for n in names]


def test_half_installed_kernel_packages_are_unpacked_again_before_dpkg_configures_the_rest():
    """A power cut while dpkg unpacked the kernel (tests/e2e/test_power_cut_e2e.py, dpkg's
    reinst-required flag): `dpkg --configure -a` refuses such a package and neither
    `apt --fix-broken install` nor the interrupted `apt full-upgrade` unpacks it again; only
    `apt-get install --reinstall` of the version dpkg had does. The first configure pass clears
    dpkg's journal (apt refuses to run before) and may fail; the last one's status counts."""
    from tests.unit.operations.oprun import run_op

    commands, _ = run_op(kernel_hook.finish_packages, reinstall=["proxmox-kernel-6.12.118+deb12-amd64-signed=1"])
    assert commands == [
        "DEBIAN_FRONTEND=noninteractive dpkg --configure -a >/dev/null 2>&1 || :",
        "DEBIAN_FRONTEND=noninteractive apt-get install -y --reinstall --no-install-recommends "
        "proxmox-kernel-6.12.118+deb12-amd64-signed=1",
        "DEBIAN_FRONTEND=noninteractive dpkg --configure -a"]
    assert run_op(kernel_hook.finish_packages)[0] == ["DEBIAN_FRONTEND=noninteractive dpkg --configure -a"]


def recording_tree(tmp: Path) -> Path:
    """An archive in the open tree's layout (src/nvidia and kernel-open/) whose make records the
    compilers it is given (CC, CXX) and fails: what the hook builds with, without a real compile."""
    import tarfile
    top = tmp / "tree/open-gpu-kernel-modules-580.95.05"
    (top / "kernel-open").mkdir(parents=True)
    (top / "src/nvidia").mkdir(parents=True)
    (top / "version.mk").write_text("NVIDIA_VERSION = 580.95.05\n")
    (top / "kernel-open/Kbuild").write_text("")
    (top / "Makefile").write_text(f"%:\n\t@echo 'CC=$(CC) CXX=$(CXX)' > {tmp}/make-compilers; exit 2\n")
    archive = tmp / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return archive


def test_a_gcc_14_kernel_on_a_host_with_gcc_12_and_gcc_14_is_built_with_gcc_14(tmp_path):
    """Issue 40: the hook was rendered with the converge's compiler (gcc-12 on 8) and refused 9's
    kernel (GCC 14) inside the dist-upgrade; it now takes each kernel's own: gcc-14 and g++-14
    (the open tree's src/ is C++), however the hook was installed."""
    archive = recording_tree(tmp_path)
    kernel_built_with(tmp_path, TRIXIE_GCC14, BOOKWORM_GCC12, BOOKWORM_GCC, "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0",
                      "g++ (Debian 12.2.0-14+deb12u1) 12.2.0", TRIXIE_GCC14, TRIXIE_GXX14)
    done = run(tmp_path, hook(tmp_path, archive, hashlib.sha256(archive.read_bytes()).hexdigest(), open_tree=True))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "make-compilers").read_text() == "CC=gcc-14 CXX=g++-14\n"
    log = (tmp_path / f"state/{RELEASE}.log").read_text()
    assert f"building nvidia 580.95.05 for {RELEASE} with gcc-14 and g++-14 (its CONFIG_CC_VERSION_TEXT: '{TRIXIE_GCC14}')" in log
    assert not (tmp_path / f"state/{RELEASE}.no-compiler").exists()


def dpkg_query(tmp: Path, status: str) -> None:
    """dpkg-query on the hook's PATH: every compiler under tmp/bin belongs to a package named like
    it, whose status is `status` ("install ok unpacked": dpkg has not configured it yet)."""
    (tmp / "bin/dpkg-query").write_text(
        f'#!/bin/sh\ncase "$1" in -S) echo "${{2##*/}}: $2";; -W) echo "{status}";; esac\n')
    (tmp / "bin/dpkg-query").chmod(0o755)


@pytest.mark.parametrize("case", ["absent", "unpacked"])
def test_the_apt_pass_builds_a_kernel_deferred_for_its_compiler_and_nothing_is_pinned(tmp_path, case):
    """Issue 40: inside the dist-upgrade 9's kernel (GCC 14) is configured while gcc-14 is not
    installed, or unpacked but not configured by dpkg: the hook defers it (no module, no pin: never
    8's kernel as the default of 9's system) and apt's DPkg::Post-Invoke pass at the end of the dpkg
    run builds it once gcc-14 and g++-14 are there and configured; while they are not, the pass runs nothing."""
    upgrade_host(tmp_path, "trixie")
    archive = recording_tree(tmp_path)
    gcc12 = (BOOKWORM_GCC12, BOOKWORM_GCC, "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "g++ (Debian 12.2.0-14+deb12u1) 12.2.0")
    kernel_built_with(tmp_path, TRIXIE_GCC14, *gcc12, *((TRIXIE_GCC14, TRIXIE_GXX14) if case == "unpacked" else ()))
    if case == "unpacked":
        dpkg_query(tmp_path, "install ok unpacked")
    script = hook(tmp_path, archive, hashlib.sha256(archive.read_bytes()).hexdigest(), open_tree=True)
    done = run(tmp_path, script)
    assert done.returncode == 0, done.stderr
    record = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()
    if case == "absent":
        assert record[1].endswith("install gcc-14 and g++-14"), record
    else:
        assert record[1].endswith("gcc-14 (gcc-14) is unpacked but not yet configured; g++-14 (g++-14) is unpacked but "
                                  "not yet configured (apt's pass after this dpkg run builds it once configured)"), record
    assert record[2] == ("no installed kernel of trixie has nvidia 580.95.05 modules to keep as the boot default; "
                         "deferred to apt's pass after the dpkg run that configures its compiler, else the converge")
    assert not (tmp_path / "pbt").exists() and not (tmp_path / "pin").exists(), done.stderr
    assert not (tmp_path / "make-compilers").exists() and (tmp_path / f"state/{RELEASE}.no-compiler").exists()

    path = tmp_path / "pvegpu-nvidia"
    path.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    again = subprocess.run([str(path), "--headers"], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0 and again.stderr == "", again.stderr  # still no gcc-14: nothing runs
    assert not (tmp_path / "make-compilers").exists()

    compilers(tmp_path, TRIXIE_GCC14, TRIXIE_GXX14)  # the dpkg run ends: installed and configured
    if case == "unpacked":
        dpkg_query(tmp_path, "install ok installed")
    again = subprocess.run([str(path), "--headers"], capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "make-compilers").read_text() == "CC=gcc-14 CXX=g++-14\n"
    assert not (tmp_path / f"state/{RELEASE}.no-compiler").exists()
    assert not (tmp_path / "pbt").exists()


PICK_CASES = {
    "bookworm 8 kernel": ("gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0", [BOOKWORM_GCC12, BOOKWORM_GCC,
                          "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0", "g++ (Debian 12.2.0-14+deb12u1) 12.2.0"]),
    "PVE names gcc": ("gcc (Debian 12.2.0-14+deb12u1) 12.2.0", [BOOKWORM_GCC12, BOOKWORM_GCC,
                      "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0"]),
    "9 kernel, 12 and 14": (TRIXIE_GCC14, [BOOKWORM_GCC12, BOOKWORM_GCC, "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0",
                            TRIXIE_GCC14, TRIXIE_GXX14]),
    "other revision": ("gcc-14 (Debian 14.2.0-17) 14.2.0", [TRIXIE_GCC14, "gcc (Debian 14.2.0-19) 14.2.0", TRIXIE_GXX14]),
    "Debian's triplet program": ("x86_64-linux-gnu-gcc-14 (Debian 14.2.0-19) 14.2.0",
                                 [TRIXIE_GCC14, "g++ (Debian 14.2.0-19) 14.2.0"]),
    "no gcc-14": (TRIXIE_GCC14, [BOOKWORM_GCC12, BOOKWORM_GCC, "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0"]),
    "no g++-14": (TRIXIE_GCC14, [TRIXIE_GCC14, "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0"]),
    "g++ of another revision": (TRIXIE_GCC14, [TRIXIE_GCC14, "g++-14 (Debian 14.2.0-17) 14.2.0"]),
    "clang": ("Debian clang version 14.0.6", [BOOKWORM_GCC12]),
    "Ubuntu's 4.8": ("gcc (Ubuntu 4.8.4-2ubuntu1~14.04.3) 4.8.4", ["gcc (Ubuntu 4.8.4-2ubuntu1~14.04.4) 4.8.4",
                                                                    "g++ (Ubuntu 4.8.4-2ubuntu1~14.04.4) 4.8.4"]),
}


@pytest.mark.parametrize("need_cxx", [True, False])
@pytest.mark.parametrize("case", sorted(PICK_CASES))
def test_the_hooks_compiler_is_plan_nvidia_toolchain_for(tmp_path, case, need_cxx):
    """One rule: the hook's pick_toolchain (sh, at apt time) chooses as the converge's
    plan.nvidia.toolchain_for does, for the same kernel text and the same installed compilers."""
    from plan.nvidia import toolchain_for

    cc_text, banners = PICK_CASES[case]
    spec = HostSpec(nvidia={"version": "580.95.05", "open": need_cxx,
                            "modules_source": {"url": "file:///x.tar.gz", "sha256": hashlib.sha256(b"x").hexdigest()}})
    text = kernel_hook.hook_script(spec, 2, False)
    func = text[text.index("tc_version() {"):text.index('if [ "$R" = --headers ]')]
    kb = tmp_path / "kb"
    kb.mkdir()
    (kb / ".config").write_text(f'CONFIG_CC_VERSION_TEXT="{cc_text}"\n')
    compilers(tmp_path, *banners)
    tools = tmp_path / "tools"  # the hook's utilities, and no compiler but the stubs
    tools.mkdir()
    for tool in ("sed", "head", "grep", "readlink", "dpkg-query"):
        (tools / tool).symlink_to(subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip())
    out = subprocess.run(["/bin/sh", "-c", func + 'KB=$1; pick_toolchain; echo "$CC,$CXX"', "sh", str(kb)], capture_output=True,
                         text=True, env={"PATH": f"{tmp_path / 'bin'}:{tools}"}, timeout=30)
    chosen = toolchain_for("r", cc_text, {b.split(" ", 1)[0]: b for b in banners}, need_cxx=need_cxx)
    assert out.stdout.strip() == f"{chosen['cc'] or ''},{chosen['cxx'] or ''}", out.stderr


def test_the_stage_installs_the_hook_under_its_new_name_and_then_removes_the_old_one(tmp_path, monkeypatch):
    """Issue 38 §3: a host converged by an older pvegpu has the hook as
    /etc/kernel/postinst.d/pvegpu-nvidia (after initramfs-tools in run-parts' order). The stage
    writes 00pvegpu-nvidia, then removes the old name (in that order: no moment without a hook);
    the next run, both as they should be, changes nothing. The stage's own plan (operations
    recorded, not run; the facts as given)."""
    from types import SimpleNamespace

    from facts.kernel_hook import KernelHookState
    from operations.files import sha256_text

    archive = tmp_path / "tree.tar.gz"
    spec = HostSpec(kernel_updates="follow", nvidia={"version": "580.95.05", "open": True,
                    "modules_source": {"url": f"file://{archive}", "sha256": hashlib.sha256(b"tree").hexdigest()}})
    calls: list[tuple[str, str]] = []

    def record(kind):
        return lambda name, **kwargs: calls.append((kind, kwargs.get("path") or " ".join(kwargs.get("paths") or [])))

    nv_state = {"sources": {"modules": {"cached": True}}, "releases": {}, "compilers": {}}
    fake_nvidia = SimpleNamespace(_state_and_steps=lambda spec: (nv_state, [], {"fetch_modules": False, "jobs": 2,
                                                                               "ccache": False}),
                                  cached_source=lambda source: str(archive))
    content = "#!/bin/sh\n# the hook\n"
    monkeypatch.setattr(kernel_hook, "host", SimpleNamespace(name="h"))
    monkeypatch.setattr(kernel_hook, "nvidia", fake_nvidia)
    monkeypatch.setattr(kernel_hook, "hook_script", lambda *a, **k: content)
    for name in ("managed_file", "remove_hook", "install_default_headers", "apt_mark", "forget_failures"):
        monkeypatch.setattr(kernel_hook, name, record(name))
    state = {**KernelHookState.default(), "hook": True, "packages": {"proxmox-default-headers": {"version": "1"}}}
    conf = render_template("kernel-headers-apt.conf.j2", path=kernel_hook.HEADERS_CONF, hook=kernel_hook.HOOK)
    old = {"mode": "755", "sha256": sha256_text("#!/bin/sh\n# an older pvegpu's hook\n")}

    def plan(files: dict) -> list[tuple[str, str]]:
        calls.clear()
        monkeypatch.setattr(kernel_hook, "fact_once", lambda fact, **kwargs: files)
        kernel_hook._hook_and_holds(spec, state)
        return list(calls)

    older = plan({kernel_hook.HOOK: None, kernel_hook.OLD_HOOK: old, kernel_hook.HEADERS_CONF: None,
                  kernel_hook.HOLD_RECORD: None})
    assert older == [("managed_file", kernel_hook.HEADERS_CONF), ("managed_file", "/etc/kernel/postinst.d/00pvegpu-nvidia"),
                     ("remove_hook", "/etc/kernel/postinst.d/pvegpu-nvidia")], older
    again = plan({kernel_hook.HOOK: {"mode": "755", "sha256": sha256_text(content)}, kernel_hook.OLD_HOOK: None,
                  kernel_hook.HEADERS_CONF: {"mode": "644", "sha256": sha256_text(conf)}, kernel_hook.HOLD_RECORD: None})
    assert again == [], again


# -- ESPs not in one loader mode (issue 38; plan.loader esp_mode_problems): the hook, run inside apt
# without pvegpu, pins, unpins and arms nothing there

def esp_host(tmp: Path, esps: dict[str, list[str]], uefi: bool = True) -> None:
    """An ESP host (grub_host's kernels and modinfo): proxmox-boot-tool logs what it is asked; each
    ESP of `esps` a directory holding those files/dirs; `unshare` runs the hook's inner script with
    /mnt under `tmp`, whose `mount` links the ESP there (the hook's own reading, minus the kernel)."""
    grub_host(tmp, [GOOD, RELEASE])
    (tmp / "proxmox-boot-uuids").write_text("".join(f"{u}\n" for u in esps))
    if uefi:
        (tmp / "efi").mkdir()
    for uuid, marks in esps.items():
        for mark in marks:
            target = tmp / "esps" / uuid / mark
            if mark == "grub":
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text("")
    stubs = {"proxmox-boot-tool": f'echo "$*" >> {tmp}/pbt',
             "bootctl": f'echo "$*" >> {tmp}/bootctl',
             "unshare": f'shift 5; script=$(printf "%s" "$1" | sed "s|/mnt|{tmp}/mnt|g"); shift; exec /bin/sh -c "$script" "$@"',
             "mount": f'ln -sfn {tmp}/esps/"${{3##*/}}" {tmp}/mnt',
             "umount": f"rm -f {tmp}/mnt"}
    stubs_on_path(tmp, stubs)


MIXED = {"5A1C-9E27": ["EFI/proxmox/grubx64.efi", "grub"], "7B2D-1F30": ["loader/loader.conf"]}
REINIT_OVER_GRUB = {"5A1C-9E27": ["EFI/proxmox/grubx64.efi", "grub", "loader/loader.conf"]}


@pytest.mark.parametrize("esps, words", [
    (MIXED, "5A1C-9E27 (grub), 7B2D-1F30 (systemd-boot)"),
    (REINIT_OVER_GRUB, "5A1C-9E27 (holding both GRUB and systemd-boot)"),
])
def test_a_failed_kernel_pins_nothing_on_esps_not_in_one_mode(tmp_path, esps, words):
    esp_host(tmp_path, esps)
    (tmp_path / "bin/modinfo").write_text(f'#!/bin/sh\ncase " $* " in *" {GOOD} "*) echo 580.95.05 ;; esac\n')
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest(),
                              efi_dir=str(tmp_path / "efi")))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "pbt").exists() and not (tmp_path / "bootctl").exists(), done.stderr
    kept = (tmp_path / f"state/{RELEASE}.failed").read_text().splitlines()[2]
    assert kept.startswith(f"the ESPs in {tmp_path}/proxmox-boot-uuids are not in one boot-loader mode: {words}; "), kept
    assert "pvegpu leaves the boot loader alone" in kept and kept.endswith(f"{RELEASE} may become the boot default")


def test_a_kernel_that_builds_moves_no_pin_on_esps_not_in_one_mode(tmp_path):
    esp_host(tmp_path, MIXED)
    (tmp_path / "state").mkdir()
    (tmp_path / "state/pinned").write_text(f"{GOOD}\n")  # the hook's pin for an earlier failure
    (tmp_path / "pin").write_text(f"{GOOD}\n")
    (tmp_path / "modules" / RELEASE / "updates/pvegpu-nvidia").mkdir(parents=True)
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest(),
                              efi_dir=str(tmp_path / "efi")))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "pbt").exists(), done.stderr  # neither unpinned nor pinned on
    assert "are not in one boot-loader mode: 5A1C-9E27 (grub), 7B2D-1F30 (systemd-boot)" in done.stderr


@pytest.mark.parametrize("esps, uefi", [
    ({"5A1C-9E27": ["loader/loader.conf"], "7B2D-1F30": ["loader/loader.conf"]}, True),
    ({"5A1C-9E27": ["EFI/proxmox/grubx64.efi", "grub"]}, True),
    ({"5A1C-9E27": ["grub", "loader/loader.conf"], "7B2D-1F30": ["grub"]}, False),  # legacy BIOS: GRUB on each
])
def test_esps_in_one_mode_are_pinned_as_before(tmp_path, esps, uefi):
    esp_host(tmp_path, esps, uefi=uefi)
    (tmp_path / "bin/modinfo").write_text(f'#!/bin/sh\ncase " $* " in *" {GOOD} "*) echo 580.95.05 ;; esac\n')
    done = run(tmp_path, hook(tmp_path, tmp_path / "none.tar.gz", hashlib.sha256(b"none").hexdigest(),
                              efi_dir=str(tmp_path / "efi")))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pbt").read_text().splitlines() == [f"kernel pin {GOOD}"], done.stderr
