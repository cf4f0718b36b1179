"""operations.kernel / operations.reboot: facts in, commands out; the detach/attach logic and the
build scripts run for real in a local shell (no host needed)."""

import json
import os
import re
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import FunctionCommand
from pyinfra_testing.util import get_command_string

from facts import kernel as kernel_facts
from operations import kernel, nvidia, reboot
from operations.files import write_file_command
from plan import kernel as plan
from plan.render import render_template, root_dirs
from spec.models import KernelSpec
from tests.unit.operations.oprun import run_op

TARBALL = {"kind": "tarball", "url": "file:///var/cache/linux-source-6.1.tar.xz", "sha256": "a" * 64}
GIT = {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}


def sh(cmd, **kw):
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, **kw)


def script_for(k: KernelSpec, base="running", jobs=4):
    return kernel.build_script(k, base, jobs, "/b")


def test_tarball_script_verifies_sha_configures_and_runs_bindeb_pkg():
    k = KernelSpec(version="6.1.192-pvegpu-ci", source=TARBALL, config_fragments=["CONFIG_64BIT=y", "CONFIG_MODULES=y"])
    text = script_for(k, base="tinyconfig", jobs=2)
    assert sh(f"sh -n /dev/stdin <<'EOF'\n{text}\nEOF").returncode == 0
    assert "sha256sum -c -" in text and "make tinyconfig" in text
    assert "printf '%s\\n' CONFIG_64BIT=y CONFIG_MODULES=y > pvegpu.config" in text
    assert "merge_config.sh -m .config pvegpu.config" in text
    assert 'make -j2 CC="ccache gcc" LOCALVERSION=-pvegpu-ci KDEB_PKGVERSION=1 KDEB_COMPRESS=gzip bindeb-pkg' in text
    assert "xz -dc -T0 source.tar | tar -x -C src --strip-components=1" in text
    assert "cp -- /var/cache/linux-source-6.1.tar.xz source.tar.part" in text
    running = script_for(KernelSpec(version="6.1.192-x", source=TARBALL, ccache=False))
    assert 'cp "/boot/config-$(uname -r)" .config' in running and "ccache" not in running


def test_proxmox_git_script_follows_the_pve_kernel_readme():
    k = KernelSpec(version="6.14.8-2-pve", source=GIT)
    text = script_for(k, jobs=12)
    assert sh(f"sh -n /dev/stdin <<'EOF'\n{text}\nEOF").returncode == 0
    # the ref's Build-Depends (debian/control of debian.prepared) before the submodules are fetched
    order = ["git checkout --force ad58d1445425ea4742e3470b2edbee35df0657e9", "pvegpu-kvname", "make debian.prepared", "dpkg-checkbuilddeps",
             "mk-build-deps -ir", "git submodule update", "make build-dir-fresh",
             'export PATH="/usr/lib/ccache:$PATH"', "dpkg-buildpackage --jobs=12 -b -uc -us"]
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions)
    # pve-kernel has no PVE_KERNEL_CC, and its `make deb` would run dpkg-buildpackage --jobs=auto
    assert "PVE_KERNEL_CC" not in text and not re.search(r"^[^#]*make deb\b", text, re.M)


def test_manifest_is_json_once_build_sh_fills_it(tmp_path):
    k = KernelSpec(version="6.1.192-x", source=TARBALL)
    text = render_template("kernel-build-manifest.json.j2", build_id=plan.build_id(k), version=k.version, kind="tarball",
                           url=k.source.url, ref=k.source.sha256, base_config="running", fragments=['CONFIG_X="a b"'], jobs=2)
    (tmp_path / "manifest.json.in").write_text(text)
    (tmp_path / "build.log").write_text("  CC      init/main.o\n  LD      vmlinux.o\n")
    # the tail of build.sh that fills the manifest, run for real
    tail = script_for(k).split("compiler=$(gcc", 1)[1].split('echo "pvegpu: build of', 1)[0]
    r = sh(f"cd {tmp_path} && source_sha=abc config_sha=def; compiler=$(gcc{tail}")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["build_id"] == plan.build_id(k) and manifest["objects"] == 2
    assert manifest["compiler"].startswith("gcc") and manifest["config_sha256"] == "def"


def test_a_tarball_build_leaves_no_module_signing_key_behind(tmp_path):
    """Issue 39 item 9: the kernel's own bindeb-pkg signs the modules with the key pair the build
    makes (certs/signing_key.pem) and keeps it; pve-kernel's debian/rules removes its copy. build.sh
    (run for real: a tarball of a stand-in tree, a make that writes the key and the packages) removes
    every certs/signing_key.pem under src/ when the build ends, and still when it fails."""
    tree = tmp_path / "tree/linux-6.1.192"
    (tree / "certs").mkdir(parents=True)
    (tree / "certs/Makefile").write_text("")
    archive = tmp_path / "linux.tar"
    subprocess.run(["tar", "-C", str(tmp_path / "tree"), "-cf", str(archive), tree.name], check=True)
    sha = subprocess.run(["sha256sum", str(archive)], capture_output=True, text=True).stdout.split()[0]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # make: kernelrelease prints the release; bindeb-pkg writes the key pair and the .debs (in ..)
    (bindir / "make").write_text(
        "#!/bin/sh\ncase \"$*\" in\n"
        "  *kernelrelease*) echo 6.1.192-pvegpu;;\n"
        "  *bindeb-pkg*) [ -n \"${FAIL_BUILD:-}\" ] && { echo 'key made, then the build failed' >&2; "
        "echo key > certs/signing_key.pem; exit 2; }; "
        "echo key > certs/signing_key.pem; echo cert > certs/signing_key.x509; "
        "touch ../linux-image-6.1.192-pvegpu_1_amd64.deb;;\n"
        "esac\n")
    (bindir / "make").chmod(0o755)
    k = KernelSpec(version="6.1.192-pvegpu", source={"kind": "tarball", "url": f"file://{archive}", "sha256": sha},
                   ccache=False)
    for fail in ("", "1"):
        build = tmp_path / f"build{fail}"
        build.mkdir()
        (build / "build.sh").write_text(kernel.build_script(k, "tinyconfig", 2, str(build)))
        (build / "manifest.json.in").write_text("{}\n")
        r = subprocess.run(["sh", str(build / "build.sh")], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAIL_BUILD": fail})
        assert r.returncode == (2 if fail else 0), (build / "build.log").read_text()
        assert (build / "build.rc").read_text().strip() == ("2" if fail else "0")
        assert not list(build.rglob("signing_key.pem")), "the module-signing key was left in the build tree"
        if not fail:
            assert (build / "src/certs/signing_key.x509").exists()  # the cert stays (it is in the kernel)
            assert (build / "linux-image-6.1.192-pvegpu_1_amd64.deb").exists()


def test_build_state_read_from_a_real_build_dir(tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "build.rc").write_text("0\n")
    (d / "linux-image-6.1.192-x_1_amd64.deb").write_text("")
    (d / "manifest.json").write_text('{\n "build_id": "abc",\n "objects": 7\n}\n')
    out = sh(kernel_facts.build_state_command(str(d), "6.1.192-x")).stdout.splitlines()
    state = kernel_facts.parse_build_state(out)
    assert state["running"] is False and state["rc"] == 0
    assert state["debs"] == ["linux-image-6.1.192-x_1_amd64.deb"]
    assert state["manifest"] == {"build_id": "abc", "objects": 7}
    assert state["cores"] >= 1 and state["mem_total_kib"] > 0


def test_stage_fact_splits_kernels_and_build():
    out = ["@@pvegpu-section kernels", "@@ /boot", "6.1.0-57-amd64", "@@ running", "6.1.0-57-amd64",
           "@@pvegpu-section build", "running", "cores 2", "mem_total_kib 24000000", "pbt", "trial 6.1.192-x"]
    facts = kernel_facts.KernelStageFacts().process(out)
    assert facts["kernels"]["installed"] == ["6.1.0-57-amd64"] and facts["kernels"]["running"] == "6.1.0-57-amd64"
    b = facts["build"]
    assert b["running"] and b["pbt"] and not b["systemd"] and b["trial"] == "6.1.192-x" and b["cores"] == 2


def test_detached_build_survives_and_a_second_start_attaches(tmp_path):
    d = tmp_path / "b"
    d.mkdir()
    (d / "build.sh").write_text(
        "set -eu\ncd \"$(dirname \"$0\")\"\necho $$ > build.pid\ntrap 'echo $? > build.rc' EXIT\n"
        "echo '  CC      a.o' >> build.log\nsleep 2\necho '  CC      b.o' >> build.log\n")
    first = sh(kernel.start_build_command(str(d), systemd=False), timeout=5)
    assert first.returncode == 0
    for _ in range(50):
        if (d / "build.pid").exists():
            break
        time.sleep(0.1)
    second = sh(kernel.start_build_command(str(d), systemd=False), timeout=5)
    assert "attaching" in second.stdout
    assert kernel_facts.parse_build_state(sh(kernel_facts.build_state_command(str(d), "x")).stdout.splitlines())["running"]

    class LocalHost:
        name = "local"

        def run_shell_command(self, command):
            r = sh(get_command_string(command))
            return r.returncode == 0, SimpleNamespace(stdout_lines=r.stdout.splitlines())

    assert kernel.wait_for_build(None, LocalHost(), str(d), 2, poll_s=0.2, timeout_s=20) is True
    assert (d / "build.rc").read_text().strip() == "0"
    assert (d / "build.log").read_text().count("CC") == 2
    # a failing build makes the wait (and so the operation) fail
    (d / "build.rc").write_text("2\n")
    assert kernel.wait_for_build(None, LocalHost(), str(d), None, poll_s=0.1, timeout_s=5) is False


def test_systemd_start_uses_a_transient_unit():
    cmd = kernel.start_build_command("/var/lib/pvegpu/kernel-build/x", systemd=True)
    assert "systemd-run --unit pvegpu-kernel-build --collect" in cmd and "nohup" not in cmd


def test_systemd_start_runs_and_hands_systemd_run_the_script(tmp_path):
    """The systemd branch is a whole script (its `fi` once ended up as an argument of
    systemd-run, a syntax error on every host with systemd): run it with stand-ins that log."""
    d = tmp_path / "build dir"
    d.mkdir()
    (d / "build.rc").write_text("1\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("systemctl", "systemd-run"):
        (bindir / tool).write_text(f"#!/bin/sh\nprintf '%s\\n' {tool} \"$@\" >> \"$LOG\"\n")
        (bindir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log")}
    run = sh(kernel.start_build_command(str(d), systemd=True, memory_max_kib=1024), env=env, timeout=5)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "log").read_text().splitlines() == [
        "systemctl", "reset-failed", "pvegpu-kernel-build",
        "systemd-run", "--unit", "pvegpu-kernel-build", "--collect", "--property=KillMode=control-group",
        "--property=MemoryMax=1024K", "--property=MemorySwapMax=0", f"--working-directory={d}", "/bin/sh",
        f"{d}/build.sh"]
    assert not (d / "build.rc").exists(), "the last attempt's status is gone before the new one starts"


def test_build_op_writes_starts_and_waits_or_only_waits_when_attaching():
    cmds, _ = run_op(kernel.build_kernel, "/b", "script", "{}", False, None, True)
    assert "/b/build.sh" in cmds[0] and "/b/manifest.json.in" in cmds[1] and "setsid nohup" in cmds[2]
    assert isinstance(cmds[3], FunctionCommand)
    cmds, _ = run_op(kernel.build_kernel, "/b", "script", "{}", False, None, False)
    assert len(cmds) == 1 and isinstance(cmds[0], FunctionCommand)


def test_a_tarball_kernel_goes_on_proxmox_boot_tools_manual_list_where_it_keeps_esps():
    """Issue 38 item 2.8: refresh syncs Proxmox's kernel packages only (proxmox-kernel-helper
    kernel_keep_versions); a linux-image-<rel> of a tarball build would leave the ESPs at the next one."""
    cmds, _ = run_op(kernel.install_kernel, "/b", "6.12.118+deb12-amd64", "tarball", None, True)
    assert cmds[0].startswith("DEBIAN_FRONTEND=noninteractive dpkg -i -- /b/linux-image-6.12.118+deb12-amd64_*.deb")
    assert cmds[1] == "proxmox-boot-tool kernel add 6.12.118+deb12-amd64 && proxmox-boot-tool refresh"
    # Proxmox's own package shape is kept by refresh; a host without ESPs has no list to keep
    for args in (("6.14.8-2-pve", "proxmox-git", None, True), ("6.12.118+deb12-amd64", "tarball", None, False)):
        cmds, _ = run_op(kernel.install_kernel, "/b", *args)
        assert not any("kernel add" in str(c) for c in cmds)


def test_install_keeps_running_kernel_and_records_manifest():
    cmds, _ = run_op(kernel.install_kernel, "/b", "6.14.8-2-pve", "proxmox-git")
    assert cmds[0] == ("DEBIAN_FRONTEND=noninteractive dpkg -i -- /b/proxmox-kernel-6.14.8-2-pve_*.deb "
                       "/b/proxmox-headers-6.14.8-2-pve_*.deb")
    assert "apt-get" not in cmds[0] and "remove" not in cmds[0]
    # the state dir made and checked root's alone first (templates/root-dir.sh.j2)
    assert cmds[1] == root_dirs(("/var/lib/pvegpu/kernel", "700")) + "cp -- /b/manifest.json /var/lib/pvegpu/kernel/6.14.8-2-pve.json"
    assert cmds[1].startswith(render_template("root-dir.sh.j2"))


def test_trial_boot_sets_the_loaders_one_shot_and_marks_it_last():
    cmds, _ = run_op(kernel.trial_boot, "6.14.8-2-pve", "systemd-boot", 10)
    assert cmds[0] == plan.trial_pending_command("6.14.8-2-pve")  # the kernel hook leaves its default alone
    assert cmds[1] == plan.zfs_guard_command("6.14.8-2-pve")  # a kernel that cannot import the root pool is not tried
    assert cmds[2] == plan.oneshot_command("6.14.8-2-pve", "systemd-boot", 10)
    assert "bootctl set-oneshot" in cmds[2] and "--next-boot" not in cmds[2]
    # the boot unit that records the trial kernel's boot, then its wants link, the marker last
    units = plan.trial_up_files()
    assert cmds[3:5] == [write_file_command(path, content, mode, keep_previous=False)
                         for path, (content, mode) in units.items()]
    assert list(units) == ["/var/lib/pvegpu/kernel/trial-up.sh", "/etc/systemd/system/pvegpu-kernel-trial.service"]
    assert cmds[5] == ("ln -sfn -- /etc/systemd/system/pvegpu-kernel-trial.service "
                       "/etc/systemd/system/multi-user.target.wants/pvegpu-kernel-trial.service")
    assert cmds[6] == plan.arm_trial_command("6.14.8-2-pve") and len(cmds) == 7
    assert "/var/lib/pvegpu/kernel/trial-boot" in cmds[6] and "/run/pvegpu/kernel-trial" in cmds[6]
    assert "rm -f /var/lib/pvegpu/kernel/trial-up &&" in cmds[6]  # the last trial's record goes
    # set up again after a reset cut the last trial's run (once): recorded before the marker
    again, _ = run_op(kernel.trial_boot, "6.14.8-2-pve", "systemd-boot", 10, retry=True)
    assert again[6] == "printf '%s\\n' 6.14.8-2-pve > /var/lib/pvegpu/kernel/trial-retried" and again[7] == cmds[6]
    cmds, _ = run_op(kernel.trial_boot, "6.1.0-x", "grub", 10, "ab")
    assert cmds[2].endswith("grub-reboot pvegpu-trial-6.1.0-x") and "panic=" in cmds[2]


def test_trial_makes_the_running_kernel_the_default_again_and_checks_it_before_the_one_shot():
    """Issue 38 2.2/2.9: right before the one-shot, whatever moved the default since the install."""
    cmds, _ = run_op(kernel.trial_boot, "6.14.11-9-bpo12-pve", "systemd-boot", 10, None, "6.14.8-2-pve")
    assert cmds[1] == ("{ [ ! -e /etc/kernel/next-boot-pin ] || proxmox-boot-tool kernel unpin --next-boot; } && "
                       "proxmox-boot-tool kernel pin 6.14.8-2-pve && proxmox-boot-tool refresh && "
                       + plan.efi_default_command("6.14.8-2-pve"))
    assert cmds[3] == plan.oneshot_command("6.14.11-9-bpo12-pve", "systemd-boot", 10, keep="6.14.8-2-pve")
    assert "keep=6.14.8-2-pve" in cmds[3]
    cmds, _ = run_op(kernel.trial_boot, "6.14.11-9-bpo12-pve", "grub", 10, "ab", "6.14.8-2-pve")
    assert cmds[1] == plan.keep_default_command("6.14.8-2-pve", "grub", "ab")
    assert "saved_entry=gnulinux-advanced-ab>gnulinux-6.14.8-2-pve-advanced-ab" in cmds[3]
    assert cmds[3].index("grub-editenv /boot/grub/grubenv list") < cmds[3].rindex("grub-reboot pvegpu-trial-")


def test_install_makes_the_running_kernel_the_default_first_where_asked():
    """A kernel package's postinst syncs the ESPs; with no pin the loader default becomes the
    newest kernel (zz-proxmox-boot: default proxmox-*), so the running one is pinned first."""
    keep = plan.keep_default_command("6.14.8-2-pve", "grub", "ab")
    cmds, _ = run_op(kernel.install_kernel, "/b", "6.14.11-9-bpo12-pve", "proxmox-git", keep)
    assert cmds[0] == plan.GRUB_KEEP_CHECK + " && grub-set-default 'gnulinux-advanced-ab>gnulinux-6.14.8-2-pve-advanced-ab'"
    assert cmds[1].startswith("DEBIAN_FRONTEND=noninteractive dpkg -i ")


def test_reboot_stage_finishes_the_trial_and_fails_when_it_did_not_come_up():
    cmds, _ = run_op(reboot.pin_trial_kernel, "6.14.8-2-pve", "systemd-boot", "b1d")
    assert cmds == [plan.finish_trial_command("6.14.8-2-pve", "systemd-boot", "b1d", None, fail=True)]
    assert cmds[0].startswith('rel=6.14.8-2-pve; checks=; journal=; if [ "$(uname -r)" = 6.14.8-2-pve ] && checks=$(')
    assert ("); then " + plan.zfs_guard_command("6.14.8-2-pve") + " && proxmox-boot-tool kernel pin 6.14.8-2-pve && "
            "proxmox-boot-tool refresh && ") in cmds[0]
    assert cmds[0].endswith("; exit 1; fi")


def test_build_state_reads_the_esp_list():
    assert kernel_facts.parse_build_state(["esps", "pbt"])["esps"] is True
    assert kernel_facts.parse_build_state(["pbt"])["esps"] is False
    assert "[ -f /etc/kernel/proxmox-boot-uuids ] && echo esps" in kernel_facts.build_state_command("/b", "6.14.8-2-pve")


def test_remove_old_is_a_noop_without_packages():
    cmds, noop = run_op(kernel.remove_old_kernels, [])
    assert cmds == [] and noop == "no old kernels to remove"
    cmds, _ = run_op(kernel.remove_old_kernels, ["proxmox-kernel-6.8.12-4-pve-signed"])
    assert cmds == [plan.purge_command(["proxmox-kernel-6.8.12-4-pve-signed"])]


def test_build_state_lists_installed_kernel_packages():
    state = kernel_facts.parse_build_state(["kpkg proxmox-kernel-6.8.12-4-pve-signed", "kpkg proxmox-kernel-6.8"])
    assert state["kernel_packages"] == ["proxmox-kernel-6.8.12-4-pve-signed", "proxmox-kernel-6.8"]
    assert "'proxmox-kernel-*' 'pve-kernel-*' 'linux-image-*'" in kernel_facts.build_state_command("/b", "6.1.0-x")

def test_preflight_refuses_fragments_on_proxmox_git(monkeypatch):
    from spec.models import HostSpec
    assert kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT, "config_fragments": ["CONFIG_X=y"]}))
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": []},
        "build": kernel_facts.parse_build_state(["pbt", "esps", "uefi"]), "source": None})
    assert kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT})) == []


@pytest.mark.parametrize("lines,why", [
    (["grub_default saved", "grub_advanced_id ab", "grubenv_abstraction ok lvm"], "is on lvm"),
    (["grub_default saved", "grubenv_abstraction ok ", "grubenv_fs ok ext2"], "no 'Advanced options' submenu id"),
    (["grub_default saved", "grub_advanced_id ab", "grubenv_abstraction ok ", "grubenv_fs ok btrfs"], "is on btrfs"),
    (["grub_default saved", "grub_advanced_id ab", "grubenv_abstraction ok ", "grubenv_fs ok zfs"], "is on zfs"),
    (["grub_default saved", "grub_advanced_id ab"], "grub-probe could not tell"),
    # proxmox-boot-tool's grub mode (legacy BIOS, or GRUB on the ESPs): its trial names entries by the id too
    (["pbt", "esps"], "keeps GRUB on the ESPs here, and /boot/grub/grub.cfg has no 'Advanced options' submenu id"),
])
def test_preflight_refuses_a_trial_that_would_not_be_one_boot(monkeypatch, lines, why):
    from spec.models import HostSpec
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": []}, "build": kernel_facts.parse_build_state(lines),
        "source": None})
    refusals = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT}))
    assert len(refusals) == 1 and why in refusals[0] and "kernel.trial_boot: false" in refusals[0]
    off = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT, "trial_boot": False}))
    if "grub_advanced_id ab" in lines or "esps" in lines:
        assert off == []  # the running kernel is kept the default by name (plan.kernel.default_loader)
    else:  # no entry id to keep it by: refused, not silently made the default (issue 38 2.3)
        assert len(off) == 1 and off[0].startswith("kernel.trial_boot is off") and why in off[0]




def test_preflight_takes_a_trial_on_grub_esps_with_an_entry_id(monkeypatch):
    """GRUB on proxmox-boot-tool's ESPs (its grub mode) gets a one-boot trial (next_entry in each
    ESP's grubenv) where grub.cfg names entries by id; before 2026-12-06 it was refused."""
    from spec.models import HostSpec
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": []},
        "build": kernel_facts.parse_build_state(["pbt", "esps", "grub_advanced_id ab"]), "source": None})
    assert kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT})) == []


def test_preflight_refuses_esps_of_both_loaders_before_anything_else(monkeypatch):
    """Issue 38: with one ESP in GRUB's mode and one in systemd-boot's, what refresh writes depends
    on their order (zz-proxmox-boot update_esp_func) and no one loader decision holds: refused."""
    from spec.models import HostSpec
    from tests.unit.operations.test_boot_ops import MIXED_ESPS
    for esps in (MIXED_ESPS["esps"], MIXED_ESPS["esps"][::-1]):
        state = {**MIXED_ESPS, "esps": esps, "esp_list": [e["uuid"] for e in esps]}
        monkeypatch.setattr(kernel, "stage_facts", lambda k, state=state: {
            "kernels": {"running": "6.8.12-4-pve", "installed": []},
            "build": kernel_facts.parse_build_state(["pbt", "esps", "uefi", "grub_advanced_id ab"]), "source": None,
            "loader_state": state})
        refusals = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT}))
        assert len(refusals) == 1 and "different boot loaders" in refusals[0], refusals
        assert "5A1C-9E27 (grub)" in refusals[0] and "7B2D-1F30 (systemd-boot)" in refusals[0]


def test_preflight_refuses_a_grub_esp_that_a_reinit_gave_systemd_boot(monkeypatch):
    """Issue 38: proxmox-kernel-helper after 9.2.0 (b4954f3's quoted grub*.efi glob) would reinit a
    GRUB ESP with systemd-boot; a GRUB trial armed there may never be the loader that starts: refused."""
    from spec.models import HostSpec
    from tests.unit.test_plan_loader import reinit_over_grub_esp
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": []},
        "build": kernel_facts.parse_build_state(["pbt", "esps", "uefi", "grub_advanced_id ab"]), "source": None,
        "loader_state": reinit_over_grub_esp()})
    refusals = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT}))
    assert len(refusals) == 1 and refusals[0].startswith("kernel: ESP 5A1C-9E27 holds both GRUB"), refusals


def test_preflight_refuses_a_release_already_installed_from_a_package_not_built_here(monkeypatch):
    from spec.models import HostSpec
    build = kernel_facts.parse_build_state(["pbt", "esps", "uefi", "kpkg proxmox-kernel-6.14.8-2-pve-signed"])
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": ["6.8.12-4-pve", "6.14.8-2-pve"]}, "build": build, "source": None})
    refusals = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT}))
    assert len(refusals) == 1 and "already installed from proxmox-kernel-6.14.8-2-pve-signed" in refusals[0]
    assert "KREL_EXTRA + -pvegpu" in refusals[0]
    build["installed_manifest"] = {"build_id": "ours, an earlier build"}  # ours: rebuilt, not refused
    assert kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT})) == []


def test_preflight_takes_a_package_its_finished_build_holds_for_ours_when_the_install_was_cut(monkeypatch):
    """Issue 38 §3 (tests/e2e/test_power_cut_e2e.py): a power cut after `dpkg -i` of our build
    and before install_kernel recorded its manifest left the package installed and no record:
    every later run refused it as "not built by pvegpu". The build dir's .deb of that name is
    ours; Proxmox's -signed package of the release is still refused."""
    from spec.models import HostSpec
    deb = "proxmox-kernel-6.14.8-2-pve_6.14.8-2_amd64.deb"
    build = kernel_facts.parse_build_state(["pbt", "esps", "uefi", "rc 0", f"deb {deb}",
                                            "kpkg proxmox-kernel-6.14.8-2-pve"])
    assert build["debs"] == [deb] and build["rc"] == 0
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": ["6.8.12-4-pve", "6.14.8-2-pve"]}, "build": build, "source": None})
    assert kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT})) == []
    build["kernel_packages"] = ["proxmox-kernel-6.14.8-2-pve-signed"]
    refusals = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT}))
    assert len(refusals) == 1 and "already installed from proxmox-kernel-6.14.8-2-pve-signed" in refusals[0]


def test_preflight_refuses_an_unsigned_kernel_under_secure_boot(monkeypatch):
    from spec.models import HostSpec
    build = kernel_facts.parse_build_state(["pbt", "esps", "uefi", "sb efivar 1"])
    assert build["secure_boot"] is True
    monkeypatch.setattr(kernel, "stage_facts", lambda k: {
        "kernels": {"running": "6.8.12-4-pve", "installed": ["6.8.12-4-pve"]}, "build": build, "source": None})
    refusals = kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT}))
    assert len(refusals) == 1 and refusals[0].startswith("Secure Boot is on") and "would not boot" in refusals[0]
    build["secure_boot"] = kernel_facts.parse_build_state(["sb SecureBoot disabled"])["secure_boot"]
    assert kernel.preflight(HostSpec(kernel={"version": "6.14.8-2-pve", "source": GIT})) == []


# -- the driver x kernel gate (templates/kernel-nvidia-gate.sh.j2) -----------------------------

LOGS = Path(__file__).resolve().parents[2] / "fixtures/nvidia-build-log"
GATE_RELEASE = "6.14.11-9-bpo12-pvegpu-pve"


GCC12 = "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
GCC14 = "gcc-14 (Debian 14.2.0-19) 14.2.0"


def gate_host(tmp: Path, log: str, cc: str = "gcc", cxx: str = "g++",
              cc_text: str = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0") -> tuple[str, Path]:
    """A build dir holding proxmox-headers-<rel> (a build tree whose auto.conf names `cc_text` as the
    compiler and pve-kernel's usr/lib/modules/<rel>/build link), an open tree whose kernel-open make
    prints a real failed build's log and fails as it did, and the rendered gate (building with
    `cc`/`cxx`) with every host path in `tmp`."""
    import hashlib
    import tarfile

    from operations import nvidia
    from spec.models import HostSpec
    top = tmp / "tree/open-gpu-kernel-modules-595.45.04"
    (top / "kernel-open").mkdir(parents=True)
    (top / "version.mk").write_text("NVIDIA_VERSION = 595.45.04\n")
    (top / "kernel-open/Kbuild").write_text("")
    (top / "kernel-open/recorded.log").write_text("".join((LOGS / log).read_text().splitlines(keepends=True)[2:]))
    # it also says which trees it was handed (NVIDIA's kernel-open/Makefile SYSSRC/SYSOUT)
    (top / "kernel-open/Makefile").write_text("modules:\n\t@echo \"trees: $(SYSSRC) $(SYSOUT)\"; cat recorded.log; exit 2\n")
    archive = tmp / "tree.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    pkg = tmp / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / f"usr/src/linux-headers-{GATE_RELEASE}").mkdir(parents=True)
    (pkg / f"usr/src/linux-headers-{GATE_RELEASE}/Makefile").write_text("")
    (pkg / f"usr/src/linux-headers-{GATE_RELEASE}/include/config").mkdir(parents=True)
    (pkg / f"usr/src/linux-headers-{GATE_RELEASE}/include/config/auto.conf").write_text(
        f'CONFIG_CC_VERSION_TEXT="{cc_text}"\n')
    (pkg / f"usr/lib/modules/{GATE_RELEASE}").mkdir(parents=True)
    os.symlink(f"/usr/src/linux-headers-{GATE_RELEASE}", pkg / f"usr/lib/modules/{GATE_RELEASE}/build")
    (pkg / "DEBIAN/control").write_text(f"Package: proxmox-headers-{GATE_RELEASE}\nVersion: 1\nArchitecture: all\n"
                                        "Maintainer: t <t@example.invalid>\nDescription: t\n")
    debs = tmp / "build"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(pkg),
                    str(debs / f"proxmox-headers-{GATE_RELEASE}_1_all.deb")], check=True, capture_output=True)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    spec = HostSpec(kernel={"version": GATE_RELEASE, "source": {"kind": "proxmox-git", "url": "git://x/pve-kernel.git",
                                                                "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}},
                    nvidia={"version": "595.45.04", "modules_source": {"url": f"file://{archive}", "sha256": sha}})
    script = kernel.gate_script(spec, str(debs), 2, cc, cxx)
    assert spec.nvidia is not None and spec.nvidia.modules_source is not None
    for old, new in ((nvidia.cached_source(spec.nvidia.modules_source), str(archive)),
                     (nvidia.BUILD_ROOT, str(tmp / "nvidia-build")), (plan.GATE_DIR, str(tmp / "gate"))):
        script = script.replace(old, new)
    return script, debs


def test_the_gate_refuses_a_kernel_the_driver_cannot_build_for_quoting_the_first_error(tmp_path):
    """Run for real on the recorded 595.45.04 failure: exit 1 (the stage stops before the install),
    the record quotes the first compile error and names the driver, its source and the kernel build;
    the headers were unpacked, not installed, and handed to the tree as SYSSRC/SYSOUT."""
    script, debs = gate_host(tmp_path, "595.45.04-kernel-without-of_gpio.txt")
    gcc = tmp_path / "bin"
    gcc.mkdir()
    for name in ("gcc", "g++"):
        (gcc / name).write_text("#!/bin/sh\necho 'gcc (Debian 12.2.0-14+deb12u1) 12.2.0'\n")
        (gcc / name).chmod(0o755)
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{gcc}:/usr/bin:/bin"})
    assert done.returncode == 1, done.stdout + done.stderr
    error = "kernel-open/common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file or directory"
    reason = f"nvidia 595.45.04 could not be built for kernel {GATE_RELEASE}: the build failed (exit 1): {error}"
    assert reason in done.stderr and "was not installed and is not booted" in done.stderr
    record = (tmp_path / f"gate/{GATE_RELEASE}.refused").read_text().splitlines()
    assert record[1:] == [reason, f"nvidia 595.45.04 {record[2].split()[-1]}", f"kernel build {record[3].split()[-1]}"]
    parsed = kernel_facts.parse_gate_records([f"== {GATE_RELEASE}.refused", *record])[GATE_RELEASE]
    assert parsed["reason"] == reason and parsed["version"] == "595.45.04" and len(parsed["build_id"]) == 64
    tree = f"{debs}/nvidia-gate-headers/usr/src/linux-headers-{GATE_RELEASE}"
    assert f"trees: {tree} {tree}" in (tmp_path / f"gate/{GATE_RELEASE}.log").read_text()
    assert not (debs / "nvidia-gate-headers").exists() and not (tmp_path / f"nvidia-build/595.45.04/{GATE_RELEASE}").exists()


def fake_compilers(tmp: Path, banners: dict[str, str]) -> Path:
    bindir = tmp / "bin"
    bindir.mkdir()
    for name, banner in banners.items():
        (bindir / name).write_text(f"#!/bin/sh\necho '{banner}'\n")
        (bindir / name).chmod(0o755)
    return bindir


def gate_spec():
    import hashlib

    from spec.models import HostSpec
    return HostSpec(kernel={"version": GATE_RELEASE, "source": {"kind": "proxmox-git", "url": "git://x/pve-kernel.git",
                                                                "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}},
                    nvidia={"version": "595.45.04", "modules_source": {"url": "https://x/a.tgz", "sha256": hashlib.sha256(b"a").hexdigest()}})


DEBIAN_GCCS = {"gcc": "gcc (Debian 12.2.0-14+deb12u1) 12.2.0", "gcc-12": GCC12,
               "g++": "g++ (Debian 12.2.0-14+deb12u1) 12.2.0", "g++-12": "g++-12 (Debian 12.2.0-14+deb12u1) 12.2.0"}


def test_the_gate_builds_with_the_compiler_the_nvidia_stage_picks_for_the_kernel():
    """A kernel built by `gcc-12` (its CONFIG_CC_VERSION_TEXT, or the finished build's recorded
    compiler): the NVIDIA stage builds its modules with gcc-12/g++-12 (plan/nvidia.py toolchain_for),
    so the gate does too, and shares the stage's src/ build dir; the kernel's installed headers come
    first, and a kernel not built yet is built by the host's `gcc`."""
    spec = gate_spec()
    state = {"compilers": DEBIAN_GCCS, "releases": {}}
    assert kernel.gate_toolchain(spec, state, {"compiler": GCC12}) == ("gcc-12", "g++-12")
    assert kernel.gate_toolchain(spec, {**state, "releases": {GATE_RELEASE: {"cc_version_text": GCC12}}},
                                 {"compiler": DEBIAN_GCCS["gcc"]}) == ("gcc-12", "g++-12")
    assert kernel.gate_toolchain(spec, state, None) == ("gcc", "g++")
    # none fits: the kernel's own program, which the gate's check names as missing
    assert kernel.gate_toolchain(spec, {"compilers": {"gcc": "gcc (Debian 14.2.0-19) 14.2.0"}, "releases": {}},
                                 {"compiler": GCC12}) == ("gcc-12", "g++-12")
    script = kernel.gate_script(spec, "/b", 2, *kernel.gate_toolchain(spec, state, {"compiler": GCC12}))
    assert "CC=gcc-12 CXX=g++-12" in script
    assert f"T={nvidia.src_dir('595.45.04', 'gcc-12', 'g++-12')}" in script


def test_the_gate_stops_without_a_record_when_the_kernels_compiler_is_missing_or_another(tmp_path):
    """The gate checks the unpacked headers' CONFIG_CC_VERSION_TEXT against its compilers as the
    kernel hook does: gcc-14 absent (a GCC this machine lacks), or a gcc-14 of another GCC, stops it
    naming that (the host's compiler, not the driver: no .refused record), before anything is built."""
    script, _ = gate_host(tmp_path, "595.45.04-kernel-without-of_gpio.txt", "gcc-14", "g++-14", GCC14)
    bindir = fake_compilers(tmp_path, {"gcc": DEBIAN_GCCS["gcc"], "g++": DEBIAN_GCCS["g++"]})
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"could not build nvidia 595.45.04 for kernel {GATE_RELEASE}: the compiler gcc-14 is not installed"
            in done.stderr)
    assert not (tmp_path / f"gate/{GATE_RELEASE}.refused").exists()
    assert not (tmp_path / "nvidia-build/595.45.04").exists()
    (bindir / "gcc-14").write_text("#!/bin/sh\necho 'gcc-14 (Debian 14.3.0-1) 14.3.0'\n")
    (bindir / "gcc-14").chmod(0o755)
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"})
    assert done.returncode == 1
    assert f"it was built with '{GCC14}', this host's gcc-14 is 'gcc-14 (Debian 14.3.0-1) 14.3.0'" in done.stderr
    assert not (tmp_path / f"gate/{GATE_RELEASE}.refused").exists()


def test_the_gate_stops_without_a_record_when_it_has_no_headers_to_build_against(tmp_path):
    """No headers package in the build dir and none installed: nothing is said about the driver and
    the kernel (no .refused record, the next run tries again), and nothing is installed."""
    script, debs = gate_host(tmp_path, "595.45.04-kernel-without-of_gpio.txt")
    for deb in debs.glob("*.deb"):
        deb.unlink()
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"could not build nvidia 595.45.04 for kernel {GATE_RELEASE}: no headers of it" in done.stderr
    assert not (tmp_path / f"gate/{GATE_RELEASE}.refused").exists()
def test_a_kernel_is_made_the_default_for_good_only_past_the_zfs_guard():
    """A default for good (pin, or the end of a trial that came up) checks the kernel's ZFS module
    against the root pool first, as the trial does (issue 27 part 5)."""
    cmds, _ = run_op(kernel.pin_kernel, "6.14.8-2-pve", "systemd-boot")
    assert cmds == [plan.zfs_guard_command("6.14.8-2-pve"), plan.set_default_command("6.14.8-2-pve", "systemd-boot")
                    + f" && rm -f {plan.TRIAL_PENDING} {plan.DISARM}"]
    finish = plan.finish_trial_command("6.14.8-2-pve", "grub", "b1d", "ab")
    assert finish.index(plan.zfs_guard_command("6.14.8-2-pve")) < finish.index("grub-set-default")


def trial_up_script(tmp_path: Path, release: str, running: str, checks: str) -> subprocess.CompletedProcess:
    """templates/kernel-trial-up.sh.j2 run for real with its paths under `tmp_path`, `uname -r`
    printing `running`, the checks file holding `checks` (lines the host checks loop reads)."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin/uname").write_text(f"#!/bin/sh\necho {running}\n")
    (tmp_path / "bin/uname").chmod(0o755)
    (tmp_path / "trial-boot").write_text(release + "\n")
    (tmp_path / "trial-checks").write_text(checks)
    script = render_template("kernel-trial-up.sh.j2", marker=str(tmp_path / "trial-boot"),
                             up=str(tmp_path / "trial-up"), checks_file=str(tmp_path / "trial-checks"))
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})


def test_the_trial_unit_records_at_the_trial_kernels_boot_whether_it_came_up_with_its_checks(tmp_path):
    """pvegpu-kernel-trial.service's script: on the kernel under trial, "<release> ok" when the host
    checks that held on the known-good kernel hold, "<release> failed <what>" when not; on any
    other kernel nothing."""
    rel = "6.14.11-9-bpo12-pve"
    done = trial_up_script(tmp_path, rel, rel, f"kernel {rel}\n")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "trial-up").read_text() == f"{rel} ok\n"
    done = trial_up_script(tmp_path, rel, rel, f"kernel {rel}\nkernel 6.14.8-2-pve\n")
    assert (tmp_path / "trial-up").read_text() == f"{rel} failed  the running kernel is {rel}, not 6.14.8-2-pve;\n"
    (tmp_path / "trial-up").unlink()
    done = trial_up_script(tmp_path, rel, "6.14.8-2-pve", "")
    assert done.returncode == 0 and not (tmp_path / "trial-up").exists()
    unit = plan.trial_up_files()["/etc/systemd/system/pvegpu-kernel-trial.service"][0]
    assert "ExecStart=/bin/sh /var/lib/pvegpu/kernel/trial-up.sh" in unit and "WantedBy=multi-user.target" in unit
    assert "ConditionPathExists=/var/lib/pvegpu/kernel/trial-boot" in unit
    assert plan.HOST_CHECKS_LOOP in plan.trial_up_files()["/var/lib/pvegpu/kernel/trial-up.sh"][0]


def test_a_decided_trial_removes_its_boot_unit():
    """finish (made the default, or the failure recorded) and pin take the unit, its script, its
    record and the retry marker away: a later boot runs nothing of the trial."""
    gone = ("/etc/systemd/system/pvegpu-kernel-trial.service "
            "/etc/systemd/system/multi-user.target.wants/pvegpu-kernel-trial.service /var/lib/pvegpu/kernel/trial-up.sh "
            "/var/lib/pvegpu/kernel/trial-up /var/lib/pvegpu/kernel/trial-retried")
    command = plan.finish_trial_command("6.14.8-2-pve", "systemd-boot", "b1")
    assert command.count(gone) == 2  # made the default; the failure recorded
    cmds, _ = run_op(kernel.pin_kernel, "6.14.8-2-pve", "systemd-boot")
    assert cmds[-1].endswith(f"rm -f /var/lib/pvegpu/kernel/trial-pending {gone}")


def test_the_stage_reads_the_trial_units_record_into_its_decision():
    """The build facts' `trial_up` (facts.kernel parse_build_state, the line the stage's fact
    prints) reaches plan.kernel_decision through operations.kernel.decide."""
    k = KernelSpec(version="6.14.8-2-pve", source=GIT)
    base = kernel.base_config_of(k)
    bid = plan.build_id(k, base)
    lines = [f"installed-manifest {json.dumps({'build_id': bid})}", "trial 6.14.8-2-pve", "trial_up 6.14.8-2-pve ok",
             "pbt", "esps", "uefi"]
    build = kernel_facts.parse_build_state(lines)
    kernels = {"running": "6.8.12-4-pve", "installed": ["6.8.12-4-pve", "6.14.8-2-pve"], "pinned": "6.8.12-4-pve"}
    decision = kernel.decide(k, {"build": build, "kernels": kernels}, base)
    assert decision["action"] == "trial" and decision["retry"] is True, decision
    build = kernel_facts.parse_build_state([*lines, "trial_retried 6.14.8-2-pve"])
    assert kernel.decide(k, {"build": build, "kernels": kernels}, base)["action"] == "finish"
