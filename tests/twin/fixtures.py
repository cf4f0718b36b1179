"""Pytest fixtures for digital twins (tests/twin/conftest.py imports them).

    twin_root_cache  (session)  Path of the unpacked cached root; builds it once if missing
    twin_factory     (function) factory(profile, name=None, address=None, hardware=...,
                                live_sysfs=False) -> Twin;
                                every twin it started is stopped at teardown, also when the
                                test failed; factory.stop(twin) stops one early
    kpro6_tmp_root   (function) Path of a fresh copy of a kpro6 root (hardware.install, no
                                twin started: stand-ins run against it through TWIN_ROOT);
                                installed once per test module
    pyinfra_inventory(twins, path) -> Path   a pyinfra inventory file for running twins
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.twin import hardware, runtime


def _skip_unless_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("twin tests need root (overlayfs, namespaces, chroot); CI runs as root")


@pytest.fixture(scope="session")
def twin_root_cache() -> Path:
    _skip_unless_root()
    started = time.monotonic()
    lower = runtime.ensure_root_cache()
    for name in runtime.stop_orphans():
        print(f"stopped twin {name} left by a killed test run")
    print(f"twin root cache: {lower} ready in {time.monotonic() - started:.1f} s")
    return lower


class TwinFactory:
    """Starts twins; remembers each name before starting so teardown also cleans half-starts."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, profile: str, name: str | None = None, address: str | None = None,
                 hardware: str = runtime.DEFAULT_HARDWARE, live_sysfs: bool = False,
                 cluster: str | None = None) -> runtime.Twin:
        if name is None:
            slug = re.sub(r"[^a-z0-9-]+", "-", Path(profile).stem.lower())[:12].strip("-")
            name = f"{slug or 'twin'}-{os.getpid()}-{len(self.names)}"
        self.names.append(name)
        return runtime.start(name, profile, address=address, hardware=hardware,
                             owner=os.getpid(), live_sysfs=live_sysfs, cluster=cluster)

    def stop(self, twin: runtime.Twin | str) -> None:
        runtime.stop(twin if isinstance(twin, str) else twin.name)

    def stop_all(self) -> list[str]:
        errors = []
        for name in reversed(self.names):
            try:
                runtime.stop(name)
            except Exception as e:  # keep stopping the others
                errors.append(f"{name}: {e}")
        self.names.clear()
        return errors


@pytest.fixture
def twin_factory(twin_root_cache):
    factory = TwinFactory()
    try:
        yield factory
    finally:
        errors = factory.stop_all()
        if errors:
            pytest.fail("twin teardown left something behind:\n" + "\n".join(errors))


@pytest.fixture(scope="module")
def kpro6_installed_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("base") / "kpro6"
    hardware.install(root, "kpro6")
    return root


@pytest.fixture
def kpro6_tmp_root(tmp_path, kpro6_installed_root) -> Path:
    dest = tmp_path / "kpro6"
    subprocess.run(["cp", "-a", str(kpro6_installed_root), str(dest)], check=True)
    return dest


def pyinfra_inventory(twins: list[runtime.Twin], path: Path) -> Path:
    """Write a pyinfra inventory (group `twins`) for running twins; host data names the twin.

    Host keys are per run, so known_hosts is /dev/null and strict checking is off.
    """
    hosts = [
        (t.address, {"ssh_port": t.port, "ssh_user": "root", "ssh_key": t.key,
                     "ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off",
                     "twin_name": t.name, "twin_profile": t.profile})
        for t in twins
    ]
    path.write_text(f"twins = {hosts!r}\n")
    return path
