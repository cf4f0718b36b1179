"""Issue 39 item 4: a Secure Boot signing key that is not root's alone is refused, naming the
field and the file: at the moment of use by the scripts (the NVIDIA build, which the kernel hook
runs without pvegpu, and the kernel image's sbsign) and in the stages' preflight (facts read the
owner and mode, plan decides). The scripts and the fact commands run here for real on a key file
of this test (the tests run as root: the file is uid 0)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from facts.kernel import parse_build_state
from facts.nvidia import NvidiaHostState, parse_host_state
from operations import nvidia as nvidia_ops
from plan import kernel as kernel_plan
from plan.nvidia import signing_key_refusal, signing_problems
from plan.render import render_template
from spec.models import KernelSpec, SigningSpec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a root-owned key file needs root")

BAD_MODES = [0o644, 0o640, 0o604, 0o660, 0o606]
MOK = "mok /root/mok.der is already enrolled"


def key_file(tmp_path: Path, mode: int) -> Path:
    key = tmp_path / "mok.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    key.chmod(mode)
    return key


def stubs(tmp_path: Path, *names: str) -> tuple[dict, Path]:
    """PATH with logging stand-ins for `names` first; the log of their calls."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit 0\n')
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


# ------------------------------------------------------------------ at the moment of use

@pytest.mark.parametrize("mode", BAD_MODES, ids=oct)
def test_the_nvidia_build_refuses_a_key_others_can_read_before_anything(tmp_path, mode):
    key = key_file(tmp_path, mode)
    script = nvidia_ops.build_command("/x/nv.tar.gz", "595.45.04", "6.1.0-57-amd64", "gcc-12", 2, False,
                                      signing=(str(key), "/root/mok.der"))
    env, log = stubs(tmp_path, "make", "tar", "rm", "mkdir", "strip", "modinfo")
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"pvegpu: nvidia.signing.key {key} is owner uid 0, mode {mode:o}: a signing key must be root's" in r.stderr
    assert not log.exists(), "nothing ran before the refusal"


def test_the_kernel_hook_checks_the_key_before_it_builds():
    """The hook (templates/kernel-postinst-nvidia.sh.j2, run by apt without pvegpu) includes the
    build script: the check is in it, before the build's first make."""
    from operations import kernel_hook
    from spec.models import HostSpec

    spec = HostSpec(nvidia={"version": "595.45.04", "signing": {"key": "/root/mok.pem", "cert": "/root/mok.der"},
                            "modules_source": {"url": "https://example.org/595.45.04.tar.gz",
                                               "sha256": "257089c6a8a5623bf34734d59210d322076d3a0cbe69c7c0da6a5348ebb45762"}})
    text = kernel_hook.hook_script(spec, 2, False)
    check = "stat -L -c '%u %a' -- /root/mok.pem"
    assert check in text and text.index(check) < text.index('make -C "$mk"')
    assert "nvidia.signing.key /root/mok.pem'\" is owner uid" in text


@pytest.mark.parametrize("mode, refused", [(0o600, False), (0o400, False), (0o644, True), (0o640, True)],
                         ids=["0600", "0400", "0644", "0640"])
def test_the_kernel_image_signing_refuses_a_key_others_can_read(tmp_path, mode, refused):
    key = key_file(tmp_path, mode)
    env, log = stubs(tmp_path, "openssl", "sbsign", "mv", "mktemp")
    script = kernel_plan.sign_command("6.14.11-9-bpo12-pvegpu-pve", str(key), "/root/mok.der")
    (tmp_path / "bin" / "sbverify").write_text(f'#!/bin/sh\necho "sbverify $*" >> {log}\nexit 1\n')
    (tmp_path / "bin" / "sbverify").chmod(0o755)
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    calls = log.read_text() if log.exists() else ""
    if refused:
        assert r.returncode == 1 and f"kernel.signing.key {key} is owner uid 0, mode {mode:o}" in r.stderr
        assert "sbsign" not in calls and "openssl" not in calls
    else:
        assert "is owner uid" not in r.stderr and f"sbsign --key {key}" in calls, (r.stderr, calls)


def test_an_unreadable_key_path_is_refused_by_the_check(tmp_path):
    text = render_template("signing-key-check.sh.j2", key=str(tmp_path / "none.pem"), field="nvidia.signing.key")
    r = subprocess.run(["sh", "-c", text], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and f"nvidia.signing.key {tmp_path}/none.pem cannot be read" in r.stderr


# ------------------------------------------------------------------ in the preflight

def host_state(tmp_path: Path, key: Path) -> dict:
    """NvidiaHostState's command run here for real, parsed."""
    command = NvidiaHostState().command([], signing=[str(key), "/root/mok.der"])
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60).stdout
    return parse_host_state(out.splitlines())


@pytest.mark.parametrize("mode", BAD_MODES, ids=oct)
def test_the_nvidia_preflight_refuses_a_key_others_can_read(tmp_path, mode):
    key = key_file(tmp_path, mode)
    state = host_state(tmp_path, key)
    assert state["signing_key_mode"] == {"uid": 0, "mode": mode} and state["signing_key_pem"] is True
    state.update(secure_boot=True, mok="enrolled", signing_files={str(key): True, "/root/mok.der": True})
    refusals, _ = signing_problems(state, SigningSpec(key=str(key), cert="/root/mok.der"), [])
    assert any(f"nvidia.signing.key {key} is owner uid 0, mode {mode:04o}" in r and "chmod 600" in r
               for r in refusals), refusals


def test_the_nvidia_preflight_takes_a_root_only_key(tmp_path):
    key = key_file(tmp_path, 0o600)
    state = host_state(tmp_path, key)
    state.update(secure_boot=True, mok="enrolled", signing_files={str(key): True, "/root/mok.der": True})
    assert signing_problems(state, SigningSpec(key=str(key), cert="/root/mok.der"), []) == ([], [])


@pytest.mark.parametrize("mode", [0o644, 0o640], ids=oct)
def test_the_kernel_preflight_refuses_a_key_others_can_read(tmp_path, mode):
    from facts.kernel import build_state_command

    key = key_file(tmp_path, mode)
    out = subprocess.run(["sh", "-c", build_state_command(str(tmp_path / "b"), "r", None, str(key))],
                         capture_output=True, text=True, timeout=60).stdout
    build = parse_build_state(out.splitlines())
    assert build["signing_key_mode"] == {"uid": 0, "mode": mode}
    k = KernelSpec(version="6.14.11-9-bpo12-pvegpu-pve", signing={"key": str(key), "cert": "/root/mok.der"},
                   source={"kind": "proxmox-git", "url": "git://x/pve-kernel.git",
                           "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"})
    refusal = kernel_plan.secure_boot_refusal(k, {**build, "secure_boot": True, "mok": "enrolled", "sbsign": True})
    assert refusal and f"kernel.signing.key {key} is owner uid 0, mode {mode:04o}" in refusal
    key.chmod(0o600)
    assert kernel_plan.secure_boot_refusal(k, {**build, "signing_key_mode": {"uid": 0, "mode": 0o600},
                                               "secure_boot": True, "mok": "enrolled", "sbsign": True}) is None


def test_the_rule():
    assert signing_key_refusal("f", "/k", None) is None  # unknown: the scripts still check at use
    assert signing_key_refusal("f", "/k", {"uid": 0, "mode": 0o600}) is None
    assert signing_key_refusal("f", "/k", {"uid": 0, "mode": 0o400}) is None
    assert "owner uid 1000" in (signing_key_refusal("f", "/k", {"uid": 1000, "mode": 0o600}) or "")
    assert "mode 0620" in (signing_key_refusal("f", "/k", {"uid": 0, "mode": 0o620}) or "")
