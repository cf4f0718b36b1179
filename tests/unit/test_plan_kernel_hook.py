"""plan/kernel_hook.py and facts/kernel_hook.py: how kernels move between runs (issue 25)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from facts.kernel_hook import KernelHookState, parse_kernel_hook, parse_owners
from plan import kernel_hook as plan
from spec.models import HostSpec

PACKAGES = ["ii proxmox-default-kernel 1.1.0", "ii proxmox-kernel-6.8 6.8.12-11", "ii proxmox-kernel-6.8.12-11-pve-signed 6.8.12-11",
            "un proxmox-kernel-6.5 <none>", "ii proxmox-headers-6.8 6.8.12-11"]


def state(*, holds=(), record=(), packages=PACKAGES, failed=(), running="6.8.12-11-pve",
          installed=("6.1.0-57-amd64", "6.8.12-11-pve", "6.12.118+deb12-amd64")):
    lines = ["@@ failed", *failed, "@@ holds", *holds, "@@ hold_record", *record, "@@ packages", *packages,
             "@@ running", running, "@@ headers_candidate", "(none)", "@@ installed", *installed]
    return parse_kernel_hook(lines)


def test_hold_holds_the_series_metas_installed_and_records_them():
    p = plan.updates_plan("hold", None, state())
    assert p["series"] == "6.8" and p["refusal"] is None
    assert p["hold"] == ["proxmox-default-kernel", "proxmox-kernel-6.8", "proxmox-headers-6.8"]
    assert p["record"] == sorted(p["hold"])
    assert "hold at 6.8" in p["summary"]
    again = plan.updates_plan("hold", None, state(holds=p["hold"], record=p["record"]))
    assert again["hold"] == [] and again["unhold"] == [], "a held host changes nothing"


def test_hold_takes_the_spec_kernel_series_and_refuses_one_not_installed():
    p = plan.updates_plan("hold", "6.14.8-2-pve", state())
    assert p["refusal"] and "proxmox-kernel-6.14 is not installed" in p["refusal"]


def test_follow_releases_only_the_holds_pvegpu_set():
    p = plan.updates_plan("follow", None, state(holds=["proxmox-kernel-6.8", "zfs-dkms"],
                                                record=["proxmox-default-kernel", "proxmox-kernel-6.8"]))
    assert p["unhold"] == ["proxmox-kernel-6.8"] and p["hold"] == [] and p["record"] == []


def test_failure_records_are_read_and_said():
    s = state(failed=["== 6.12.118+deb12-amd64.failed", "2026-12-04T05:00:00Z",
                      "nvidia 580.95.05 could not be built for kernel 6.12.118+deb12-amd64: the build failed",
                      "6.1.0-57-amd64 stays the boot default (pinned by pvegpu)"])
    [line] = plan.failure_lines(s)
    assert line.startswith("kernel 6.12.118+deb12-amd64: nvidia 580.95.05 could not be built")
    assert "; 6.1.0-57-amd64 stays the boot default (pinned by pvegpu); once the cause is fixed" in line
    assert plan.failure_lines(state()) == []


def test_packages_parse_installed_and_held_only():
    s = state()
    assert set(s["packages"]) == {"proxmox-default-kernel", "proxmox-kernel-6.8", "proxmox-kernel-6.8.12-11-pve-signed",
                                  "proxmox-headers-6.8"}
    assert parse_kernel_hook(["@@ packages", "hi proxmox-kernel-6.8 1"])["packages"]["proxmox-kernel-6.8"]["held"]
    assert s["headers_candidate"] is None and KernelHookState.default()["failed"] == {}


def test_headers_follow_kernels_when_apt_can():
    assert plan.headers_step(state()) == (False, plan.headers_step(state())[1])
    assert "no candidate" in (plan.headers_step(state())[1] or "")
    with_candidate = {**state(), "headers_candidate": "1.1.0"}
    assert plan.headers_step(with_candidate) == (True, None)
    has = state(packages=[*PACKAGES, "ii proxmox-default-headers 1.1.0"])
    assert plan.headers_step(has) == (False, None)


def test_kernel_updates_is_follow_or_hold():
    assert HostSpec().kernel_updates == "follow"
    assert HostSpec(kernel_updates="hold").kernel_updates == "hold"
    with pytest.raises(ValidationError, match="kernel_updates"):
        HostSpec(kernel_updates="latest")


def test_module_problems_name_version_kernel_compiler_and_firmware():
    rel, ver = "6.12.118+deb12-amd64", "580.95.05"
    cc = "x86_64-linux-gnu-gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0"
    good = {"version": ver, "vermagic": f"{rel} SMP preempt mod_unload modversions",
            "gcc": "GCC: (Debian 12.2.0-14+deb12u1) 12.2.0"}
    assert plan.module_problems(rel, ver, good, cc, {"nvidia/580.95.05/gsp_ga10x.bin": True}) == []
    assert plan.module_problems(rel, ver, {}, cc, None) == [f"kernel {rel} has nvidia missing, not {ver}"]
    other = {**good, "gcc": "GCC: (Debian 14.2.0-19) 14.2.0", "vermagic": "6.1.0-57-amd64 SMP"}
    problems = plan.module_problems(rel, ver, other, cc, {"nvidia/580.95.05/gsp_ga10x.bin": False})
    assert [p.split(":")[0] if ": " in p else p for p in problems] and len(problems) == 3
    assert "built for 6.1.0-57-amd64" in problems[0] and "14.2.0" in problems[1] and "gsp_ga10x.bin" in problems[2]
    revision = {**good, "gcc": "GCC: (Debian 12.2.0-14) 12.2.0"}
    assert plan.module_problems(rel, ver, revision, cc, None) == [], "the same GCC x.y.z is the toolchain rule's match"


def test_records_of_removed_kernels_are_stale_not_failures():
    s = {**state(failed=["== 6.12.1-1-pve.failed", "t", "nvidia could not be built", "kept",
                         "== 6.11.1-1-pve.failed", "t", "nvidia could not be built", "kept"]),
         "installed": ["6.8.12-11-pve", "6.12.1-1-pve"]}
    assert list(plan.live_failures(s)) == ["6.12.1-1-pve"]
    assert plan.stale_failures(s) == ["6.11.1-1-pve"]
    [line] = plan.failure_lines(s)  # no package owns its image (dpkg-query -S finds none): the hook itself
    assert line.startswith("kernel 6.12.1-1-pve:") and \
        "`/etc/kernel/postinst.d/00pvegpu-nvidia 6.12.1-1-pve /boot/vmlinuz-6.12.1-1-pve` runs the hook again" in line


def test_the_rerun_command_names_the_package_dpkg_says_installed_the_image():
    """Issue 38 2.7: Proxmox VE >= 8.1 installs proxmox-kernel-<rel>-signed, which only Provides
    proxmox-kernel-<rel>; `dpkg-reconfigure proxmox-kernel-<rel>` says it "is not installed"."""
    owners = parse_owners(["proxmox-kernel-6.12.1-1-pve-signed: /boot/vmlinuz-6.12.1-1-pve",
                           "diversion by foo from: /boot/vmlinuz-6.8.12-11-pve",
                           "linux-image-6.1.0-57-amd64: /boot/vmlinuz-6.1.0-57-amd64"])
    assert owners == {"6.12.1-1-pve": "proxmox-kernel-6.12.1-1-pve-signed",
                      "6.1.0-57-amd64": "linux-image-6.1.0-57-amd64"}
    s = {**state(failed=["== 6.12.1-1-pve.failed", "t", "nvidia could not be built", "kept"]),
         "installed": ["6.12.1-1-pve"], "owners": owners}
    [line] = plan.failure_lines(s)
    assert "`dpkg-reconfigure proxmox-kernel-6.12.1-1-pve-signed` runs the hook again" in line


def test_the_spec_kernel_is_refused_when_the_hook_could_not_build_this_driver_for_it():
    rec = ["== 6.12.118+deb12-amd64.failed", "t",
           "nvidia 580.95.05 could not be built for kernel 6.12.118+deb12-amd64: the build failed (exit 2): "
           "nvidia.c:4:2: error: #error \"no 6.12\"", "6.1.0-57-amd64 stays the boot default"]
    s = state(failed=rec)
    refusal = plan.driver_kernel_refusal("580.95.05", "6.12.118+deb12-amd64", s)
    assert refusal and "cannot run nvidia 580.95.05" in refusal and 'error: #error "no 6.12"' in refusal
    assert plan.driver_kernel_refusal("590.1.2", "6.12.118+deb12-amd64", s) is None, "another driver: try again"
    assert plan.driver_kernel_refusal("580.95.05", "6.1.0-57-amd64", s) is None


def test_packages_dpkg_left_midway_are_named_for_dpkg_configure_a():
    """Issue 38 §3 (a power cut during `apt full-upgrade`, tests/e2e/test_power_cut_e2e.py): dpkg's
    Status-Abbrev second letter H/U/F/W/t is a package between two states; installed (i),
    not-installed (n) and config-files (c) are not."""
    s = state(packages=[*PACKAGES, "iF proxmox-kernel-6.12.118+deb12-amd64-signed 1", "iU proxmox-default-kernel 2",
                        "it proxmox-headers-6.12 2", "rc proxmox-kernel-6.5.13-1-pve-signed 6.5.13-1"])
    assert s["unfinished"] == {"proxmox-kernel-6.12.118+deb12-amd64-signed": "half-configured",
                               "proxmox-default-kernel": "unpacked", "proxmox-headers-6.12": "triggers-pending"}
    assert plan.unfinished_packages(s) == ("proxmox-default-kernel (unpacked), proxmox-headers-6.12 (triggers-pending), "
                                           "proxmox-kernel-6.12.118+deb12-amd64-signed (half-configured)")
    assert plan.unfinished_packages(state()) is None and state()["unfinished"] == {}
    assert plan.half_installed(s) == []
    cut_in_unpack = state(packages=[*PACKAGES, "iH proxmox-kernel-6.12.118+deb12-amd64-signed 1"])
    assert plan.half_installed(cut_in_unpack) == ["proxmox-kernel-6.12.118+deb12-amd64-signed=1"]
    assert plan.unfinished_packages(cut_in_unpack) is None  # dpkg --configure -a refuses it
    # dpkg's reinst-required flag (a cut while it unpacked, the state already "unpacked"): the same
    flagged = state(packages=[*PACKAGES, "iUR proxmox-headers-6.12.118+deb12-amd64 1", "iF proxmox-kernel-6.12 2"])
    assert plan.half_installed(flagged) == ["proxmox-headers-6.12.118+deb12-amd64=1"]
