"""The twin's model of module signature enforcement (tests/twin/hardware.py module_load_refusal)
and its mokutil stand-in, on a kpro6 root rendered in a tmp dir. Modules are signed with the real
scripts/sign-file of the twin root's Debian kbuild, keys made by openssl: a module signed by a key
that is not enrolled does not load while Secure Boot (lockdown) or sig_enforce says so."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from facts.nvidia import parse_mok
from tests.twin import hardware

RELEASE_OF = lambda root: json.loads((root / "var/lib/twin/hw/state.json").read_text())["boot"]["release"]  # noqa: E731


def make_key(tmp: Path, name: str) -> tuple[Path, Path]:
    """(PEM private key, DER certificate) of a new self-signed MOK."""
    key, cert = tmp / f"{name}.pem", tmp / f"{name}.der"
    subprocess.run(["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-outform", "DER", "-out", str(cert), "-days", "3650", "-subj", f"/CN=pvegpu twin {name}"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture
def kpro6(tmp_path, twin_root_cache):
    root = tmp_path / "root"
    hardware.install(root, "kpro6")
    sign_file = next(Path(twin_root_cache).glob("usr/lib/linux-kbuild-*/scripts/sign-file"))
    module = next((root / "lib/modules" / RELEASE_OF(root)).rglob("nvidia.ko"))
    return root, sign_file, module


def state(root: Path) -> dict:
    hardware.render(root)
    return json.loads((root / "var/lib/twin/hw/state.json").read_text())


def loaded(root: Path) -> bool:
    st = state(root)
    return st["nvidia"]["loaded"] and (root / "var/lib/twin/hw/proc/driver/nvidia/version").exists()


def test_secure_boot_refuses_a_module_whose_key_is_not_enrolled(kpro6, tmp_path):
    root, sign_file, module = kpro6
    assert loaded(root), "Secure Boot off: the unsigned module loads (and taints)"
    hardware.set_secure_boot(root, True)
    assert not loaded(root)
    assert state(root)["kernel_log"] == ["nvidia: Lockdown: modprobe: unsigned module loading is restricted; "
                                         "see man kernel_lockdown.7"]
    assert all(g["driver"] is None for g in state(root)["gpus"] if g["bdf"] in ("0000:01:00.0",))
    key, cert = make_key(tmp_path, "mok")
    subprocess.run([str(sign_file), "sha512", str(key), str(cert), str(module)], check=True)
    assert not loaded(root), "signed, but by a key the firmware does not know"
    hardware.enroll_mok(root, cert.read_bytes(), pending=True)
    assert not loaded(root), "imported, MokManager confirmation not done: not trusted yet"
    other_key, other_cert = make_key(tmp_path, "other")
    hardware.enroll_mok(root, other_cert.read_bytes())
    assert not loaded(root), "another enrolled key does not verify this signature"
    hardware.enroll_mok(root, cert.read_bytes())
    assert loaded(root)


def test_sig_force_refuses_unsigned_modules_without_secure_boot(kpro6):
    root, _, _ = kpro6
    config = root / "boot" / f"config-{RELEASE_OF(root)}"
    config.write_text((config.read_text() if config.exists() else "") + "CONFIG_MODULE_SIG_FORCE=y\n")
    st = state(root)
    assert not st["nvidia"]["loaded"] and st["kernel_log"] == ["nvidia: Loading of unsigned module is rejected"]
    assert (root / "var/lib/twin/hw/sys/module/module/parameters/sig_enforce").read_text() == "Y\n"


def test_a_der_key_cannot_sign(kpro6, tmp_path):
    """What nvidia.signing.key's PEM check prevents: sign-file reads the key as PEM only."""
    root, sign_file, module = kpro6
    key, cert = make_key(tmp_path, "mok")
    der_key = tmp_path / "mok.key.der"
    subprocess.run(["openssl", "pkey", "-in", str(key), "-outform", "DER", "-out", str(der_key)], check=True)
    done = subprocess.run([str(sign_file), "sha512", str(der_key), str(cert), str(module)], capture_output=True)
    assert done.returncode != 0


def mokutil(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TWIN_ROOT=str(root))
    return subprocess.run([str(root / "usr/local/bin/mokutil"), *args], env=env, capture_output=True, text=True)


def test_mokutil_stand_in_answers_as_mokutil_does(kpro6, tmp_path):
    root, _, _ = kpro6
    key, cert = make_key(tmp_path, "mok")
    assert mokutil(root, "--sb-state").stdout == "SecureBoot disabled\n"
    hardware.set_secure_boot(root, True)
    assert mokutil(root, "--sb-state").stdout == "SecureBoot enabled\n"
    r = mokutil(root, "--test-key", str(cert))
    assert (r.returncode, r.stdout) == (1, f"{cert} is not enrolled\n")
    assert parse_mok([f"mok {line}" for line in r.stdout.splitlines()]) == "not enrolled"
    hardware.enroll_mok(root, cert.read_bytes(), pending=True)
    r = mokutil(root, "--test-key", str(cert))
    assert r.returncode == 0 and parse_mok([f"mok {r.stdout.strip()}"]) == "pending"
    hardware.enroll_mok(root, cert.read_bytes())
    r = mokutil(root, "--test-key", str(cert))
    assert r.returncode == 0 and parse_mok([f"mok {r.stdout.strip()}"]) == "enrolled"
    pem = tmp_path / "mok.crt"
    subprocess.run(["openssl", "x509", "-inform", "DER", "-in", str(cert), "-out", str(pem)], check=True)
    r = mokutil(root, "--test-key", str(pem))
    assert r.returncode == 255 and parse_mok([f"mok {r.stderr.strip()}"]) == "not DER"
