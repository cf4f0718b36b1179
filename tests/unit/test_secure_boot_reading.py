"""NvidiaHostState's Secure Boot reading: mokutil's verdict line, else the SecureBoot EFI
variable's last byte (facts.nvidia.parse_secure_boot takes the verdict line first). The variable
is read (one `od`) only where mokutil printed no verdict line; the value is what the parser made
of mokutil's line and the variable read together before."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from facts.nvidia import SECURE_BOOT_EFIVAR, NvidiaHostState, parse_secure_boot


@pytest.mark.parametrize(("mokutil", "efivar", "expected", "od_runs"), [
    ("SecureBoot enabled", 0, True, 0),           # the verdict wins over the variable
    ("SecureBoot disabled", 1, False, 0),
    ("EFI variables are not supported on this system", 1, True, 1),  # no verdict: the variable
    (None, 0, False, 1),                          # no mokutil
    ("SecureBoot enabled in setup mode", 0, False, 1),  # not the verdict line: the variable
])
def test_the_variable_is_read_only_without_mokutils_verdict(tmp_path, mokutil, efivar, expected, od_runs):
    var = tmp_path / "SecureBoot"
    var.write_bytes(bytes([6, 0, 0, 0, efivar]))  # efivarfs: 4 attribute bytes, then the value
    bin_dir, log = tmp_path / "bin", tmp_path / "od.log"
    bin_dir.mkdir()
    (bin_dir / "od").write_text(f'#!/bin/sh\necho od >> {log}\nexec {shutil.which("od")} "$@"\n')
    if mokutil is not None:
        (bin_dir / "mokutil").write_text(f"#!/bin/sh\necho '{mokutil}'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (p and os.path.exists(f"{p}/mokutil")))
    command = NvidiaHostState().command([]).replace(SECURE_BOOT_EFIVAR, str(var))
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PATH": f"{bin_dir}:{path}"}).stdout.splitlines()
    state = NvidiaHostState().process(out)
    assert state["secure_boot"] is expected
    assert (log.read_text().count("od") if log.exists() else 0) == od_runs
    # what the parser made of mokutil's line and the variable together (the old reading)
    old = ([mokutil] if mokutil else []) + [f"efivar {efivar}"]
    assert parse_secure_boot(old) is expected
