"""Secure Boot on a twin (issue 28 part 2): the NVIDIA stage refuses, before any change, to sign
modules with a certificate the firmware has not enrolled (the kernel would refuse them after the
reboot: "Key was rejected by service"); once it is enrolled, the modules are built, signed with
the kernel's own CONFIG_MODULE_SIG_HASH and installed.

A kpro6 twin with Secure Boot on (its EFI variables, tests/twin/hardware.py) and its mokutil
stand-in; the NVIDIA stage alone against Debian's 6.1 headers with the tiny module tree of
tests/e2e/test_faults.py; the real Debian sign-file signs.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import PYTEST, REPO, run_pyinfra
from tests.e2e.test_faults import DRIVER, STAGE_DEPLOY, DriverTwin, twin_sh, working_source
from tests.twin import hardware

pytestmark = [pytest.mark.twin]


def test_an_unenrolled_cert_is_refused_then_the_enrolled_one_signs_with_the_kernels_hash(twin_factory, tmp_path):
    d = DriverTwin(twin_factory("kpro6", name=f"i28sb-{os.getpid() % 10000}"), tmp_path)
    root = Path(d.twin.root)
    subprocess.run(["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(root / "root/mok.pem"), "-outform", "DER", "-out", str(root / "root/mok.der"), "-days", "3650",
                    "-subj", "/CN=pvegpu twin MOK"], check=True, capture_output=True)
    hardware.set_secure_boot(root, True)
    # a Proxmox kernel signs with sha512; Debian's 6.1 with sha256: make this one say sha512
    conf = f"/lib/modules/{d.release}/build/include/config/auto.conf"
    twin_sh(d.twin, f"sed -i 's/^CONFIG_MODULE_SIG_HASH=.*/CONFIG_MODULE_SIG_HASH=\"sha512\"/' {conf} && "
                    f"grep -q '^CONFIG_MODULE_SIG_HASH=\"sha512\"' {conf}")
    path, sha = d.put("tiny-nvidia.tar.gz", working_source(d.release))
    spec = {"hosts": {d.twin.name: {
        "ssh": {"hostname": d.twin.address, "port": d.twin.port, "user": "root", "key": d.twin.key},
        "node": "kpro6",
        "nvidia": {"version": DRIVER, "modules_source": {"url": path, "sha256": sha}, "firmware": False,
                   "persistenced": False, "releases": [d.release],
                   "signing": {"key": "/root/mok.pem", "cert": "/root/mok.der"}}}}}
    (tmp_path / "signing.yml").write_text(json.dumps(spec))
    inventory = tmp_path / "signing_inventory.py"
    overrides = {d.twin.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
    inventory.write_text("from spec.load import inventory_hosts\n"
                         f"hosts = inventory_hosts({str(tmp_path / 'signing.yml')!r}, overrides={overrides!r})\n")
    before = d.installed()

    run = run_pyinfra(str(inventory), STAGE_DEPLOY, env={"PVEGPU_STAGES": "operations.nvidia"})
    assert run.rc != 0
    assert ("nvidia.signing.cert /root/mok.der is not enrolled as a machine owner key" in run.output
            and "because Secure Boot is on" in run.output), run.output[-3000:]
    assert d.installed() == before, "a refused run changed the installed modules"

    hardware.enroll_mok(root, (root / "root/mok.der").read_bytes())
    run = run_pyinfra(str(inventory), STAGE_DEPLOY, env={"PVEGPU_STAGES": "operations.nvidia"})
    assert run.rc == 0, run.output[-3000:]
    info = twin_sh(d.twin, f"modinfo -k {d.release} nvidia")
    assert f"version:        {DRIVER}" in info and "signer:         pvegpu twin MOK" in info, info
    assert "sig_hashalgo:   sha512" in info, info

    # the host check asks the firmware, not the signer's name: enrolled passes, withdrawn fails
    def check():
        return subprocess.run([PYTEST, "-q", "-p", "no:cacheprovider", "tests/host/test_nvidia.py", "--inventory",
                               str(inventory), "-k", "signed"], cwd=REPO, capture_output=True, text=True, timeout=600)
    done = check()
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:]
    for enrolled in (root / hardware.EFI_DIR / "MokListRT").iterdir():
        enrolled.unlink()
    done = check()
    assert done.returncode == 1 and "is not enrolled as a machine owner key" in done.stdout \
        and "Key was rejected by service" in done.stdout, done.stdout[-3000:]
