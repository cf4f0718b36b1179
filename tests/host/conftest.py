"""Host checks (pytest-testinfra), parametrised from a pyinfra inventory.

    pytest tests/host --inventory inventories/kpro6.py

Hosts and their specs come from the same inventory files pyinfra uses (so the same YAML). Each
check takes the `target` fixture:

    target.name   inventory host name        target.spec  the validated HostSpec
    target.host   a testinfra Host            target.run(cmd) -> (rc, stdout)
    target.fact(FactClass, *args) -> the fact read on the host (its own command and parser;
                  read once per host and arguments for the whole session)

Assertion messages are sentences about the host; a failing check is reported as that sentence
(see pytest_runtest_makereport), not as a Python traceback. A host that cannot be reached (its
name does not resolve, nothing answers on its ssh port, ssh refuses the login) fails its first
check with one sentence naming host, address and why; its other checks are not run (skipped).
"""

from __future__ import annotations

import runpy
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest
import testinfra


def pytest_addoption(parser):
    parser.addoption("--inventory", action="store", default=None,
                     help="pyinfra inventory file whose hosts (and specs) the checks run against")


def _inventory_hosts(path: str) -> list[tuple[str, dict]]:
    namespace = runpy.run_path(path)
    hosts: list[tuple[str, dict]] = []
    for key, value in namespace.items():
        if key.startswith("_") or not isinstance(value, (list, tuple)):
            continue
        for item in value:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], dict) and "pvegpu_spec" in item[1]:
                hosts.append(item)
    return hosts


@dataclass
class Target:
    name: str
    data: dict
    host: Any = field(repr=False)
    facts: dict = field(default_factory=dict, repr=False)
    reached: bool | None = None  # None: not tried yet
    unreachable: str | None = None  # why not, once tried

    @property
    def spec(self):
        return self.data["pvegpu_spec"]

    def run(self, command: str) -> tuple[int, str]:
        result = self.host.run(command)
        return result.rc, result.stdout

    def fact(self, fact_class, *args):
        """`fact_class` read on the host as pyinfra reads it (no output: the fact's default)."""
        from facts.hardware import fact_command, fact_value

        key = (fact_class, args)
        if key not in self.facts:
            lines = self.run(fact_command(fact_class(), args))[1].splitlines()
            self.facts[key] = fact_value(fact_class, lines)
        return self.facts[key]

    def read(self, path: str) -> str | None:
        """File content, or None when it does not exist."""
        rc, out = self.run(f"cat {quote(path)} 2>/dev/null")
        return out if rc == 0 else None


def quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


def _testinfra_host(name: str, data: dict):
    if name.startswith("@local"):
        return testinfra.get_host("local://")
    hostname = data.get("ssh_hostname", name)
    user = data.get("ssh_user", "root")
    port = data.get("ssh_port", 22)
    kwargs = {}
    if data.get("ssh_key"):
        kwargs["ssh_identity_file"] = data["ssh_key"]
    return testinfra.get_host(f"paramiko://{user}@{hostname}:{port}", **kwargs)


_TARGETS: dict[str, Target] = {}
CONNECT_TIMEOUT_S = 10


def _unreachable(t: Target) -> str | None:
    """Why `t` cannot be checked (a sentence naming host, address and cause), or None."""
    if t.name.startswith("@local"):
        return None
    hostname = t.data.get("ssh_hostname", t.name)
    port = int(t.data.get("ssh_port", 22))
    user = t.data.get("ssh_user", "root")
    try:
        address = str(socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError) as e:
        return (f"{t.name}: cannot reach {hostname}: the name does not resolve "
                f"({getattr(e, 'strerror', None) or e}); set ssh.hostname to a name or address this machine reaches")
    try:
        with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        why = f"no answer within {CONNECT_TIMEOUT_S} s" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        return f"{t.name}: cannot reach {hostname} ({address}) on ssh port {port}: {why}"
    try:
        t.host.run("true")
    except Exception as e:  # paramiko's and testinfra's own errors: authentication, key, protocol
        return (f"{t.name}: {hostname} ({address}) answers on port {port}, but ssh as {user} fails: "
                f"{type(e).__name__}: {e}")
    return None


def pytest_generate_tests(metafunc):
    if "target" not in metafunc.fixturenames:
        return
    inventory = metafunc.config.getoption("--inventory")
    if not inventory:
        pytest.exit("host checks need --inventory <pyinfra inventory file>, e.g. inventories/kpro6.py", returncode=4)
    hosts = _inventory_hosts(inventory)
    metafunc.parametrize("target", [name for name, _ in hosts], indirect=True, ids=[name for name, _ in hosts])
    for name, data in hosts:
        _TARGETS.setdefault(name, Target(name, data, None))


@pytest.fixture
def target(request) -> Target:
    t = _TARGETS[request.param]
    if t.host is None:
        t.host = _testinfra_host(t.name, t.data)
    if t.reached is None:
        t.unreachable = _unreachable(t)
        t.reached = t.unreachable is None
        if t.unreachable:
            pytest.fail(t.unreachable, pytrace=False)  # the one failure for this host
    if t.unreachable:
        pytest.skip(f"{t.name}: not checked, the host cannot be reached (see its first check)")
    return t


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and call.excinfo.errisinstance(AssertionError):
        message = str(call.excinfo.value).split("\nassert ")[0].strip()
        if message:
            report.longrepr = f"{item.nodeid}\n  HOST CHECK FAILED: {message}"
    target = _TARGETS.get(getattr(getattr(item, "callspec", None), "params", {}).get("target", ""))
    if report.when == "setup" and report.failed and target is not None and target.unreachable:
        # an unreachable host is a failed check of that host, not an error of the test suite
        report.when = "call"
        report.longrepr = f"{item.nodeid}\n  HOST CHECK FAILED: {target.unreachable}"
